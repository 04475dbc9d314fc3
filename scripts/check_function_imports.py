"""List the imports inside functions that have no comment saying why they are there.

An import inside a function hides a module's dependencies from its reader. loom keeps one only
where it keeps torch (or another heavy dependency) out of a process that must not load it, for
an optional dependency, or to break an import cycle, and says so in a comment on the same line
or the line above (one comment covers a run of imports on consecutive lines below it).
``python scripts/check_function_imports.py [ROOT ...]`` prints each import without one and
exits 1 if there is any. Module- and class-level imports (an import under
``if TYPE_CHECKING:`` included) are not checked.
"""

from __future__ import annotations

import ast
import sys
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROOTS = (*sorted(REPO.glob("packages/*/src")), REPO / "supervisor-rs" / "python")
MESSAGE = ("import inside function without a comment saying why (keep it lazy only to keep "
           "torch/heavy deps out of a process, or for an optional dependency)")
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def comment_lines(path: Path) -> set[int]:
    """The numbers of the lines that carry a comment."""
    with tokenize.open(path) as f:
        return {tok.start[0] for tok in tokenize.generate_tokens(f.readline) if tok.type == tokenize.COMMENT}


def function_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements nested (at any depth) inside a function or method body."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import | ast.ImportFrom):
                found.append(child)
            visit(child, in_function or isinstance(child, _FUNCTIONS))

    visit(tree, False)
    return found


def offences(path: Path) -> list[int]:
    """The lines of ``path`` holding an import inside a function with no comment on its lines or
    the line above; one comment covers a run of imports on consecutive lines below it."""
    comments = comment_lines(path)
    tree = ast.parse(path.read_bytes(), filename=str(path))
    found: list[int] = []
    covered_until = -1  # the last line of the run of commented imports seen last
    for node in sorted(function_imports(tree), key=lambda n: n.lineno):
        lines = set(range(node.lineno - 1, (node.end_lineno or node.lineno) + 1))
        if lines & comments or node.lineno - 1 == covered_until:
            covered_until = node.end_lineno or node.lineno
        else:
            found.append(node.lineno)
    return found


def main(argv: list[str]) -> int:
    roots = [Path(arg).resolve() for arg in argv] or list(DEFAULT_ROOTS)
    files = sorted({f for root in roots for f in ([root] if root.is_file() else root.rglob("*.py"))})
    count = 0
    for path in files:
        for line in offences(path):
            print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}: {MESSAGE}")
            count += 1
    print(f"{count} uncommented import(s) inside functions in {len(files)} file(s)")
    return 1 if count else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
