"""``--chat-template``: a Jinja template file, or the template itself, checked before anything runs."""

from __future__ import annotations

import codecs
from pathlib import Path

from ..transformers_utils.fast_tokenizer import compile_chat_template

_JINJA_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template`` (vLLM's semantics): the contents of the file
    ``value`` names, or ``value`` itself when it is no file and reads as a template (it has
    ``{``, ``}`` or a newline; escapes like ``\\n`` in it are interpreted). Raises
    ``ValueError`` with a one-line message when the file is missing or unreadable or the
    template does not parse.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
        source = f"file {value!r}"
    elif any(c in value for c in _JINJA_CHARS):
        text = value
        if "\\" in text and text.isascii():  # typed on a command line: "\n" means a newline
            text = codecs.decode(text, "unicode_escape")
        source = "the template given"
    else:
        raise ValueError(
            f"--chat-template: file {value!r} not found (and the value has no Jinja markup, so it is no "
            "template either); give the path of a Jinja template file or the template text"
        )
    _check_syntax(text, source)
    return text


def _check_syntax(text: str, source: str) -> None:
    # lazy: jinja2 costs ~0.1 s of start-up in every process; only a chat template needs it
    import jinja2

    try:
        compile_chat_template(text)  # the environment the front end renders it in
    except jinja2.TemplateSyntaxError as e:  # unknown filters and tests too (TemplateAssertionError)
        raise ValueError(
            f"--chat-template: {source} does not parse as a Jinja template: line {e.lineno}: {e.message}"
        ) from None
