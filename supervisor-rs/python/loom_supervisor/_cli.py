"""The ``loom-supervisor`` console script: the Rust command line, run through the
native module (the same code as the cargo-built binary; see README.md)."""

from __future__ import annotations

import sys

from ._native import main as _main


def main() -> None:
    # `serve` asks this interpreter for the plan unless $LOOM_PYTHON says otherwise.
    sys.exit(_main(["loom-supervisor", *sys.argv[1:]], sys.executable))


if __name__ == "__main__":
    main()
