"""``FastTokenizer``: an HF ``tokenizer.json`` driven by the ``tokenizers`` library alone.

The front end and the engine core of a serve tokenize, detokenize and render chat
templates, but never compute. ``transformers`` imports torch, which costs each of those
processes seconds of start-up and about 250 MB, so they read the tokenizer files directly:
``tokenizer.json`` (the model, normalizer, pre-tokenizer, post-processor and decoder),
``tokenizer_config.json`` (special tokens) and the chat template (``chat_template.jinja``
or the config's ``chat_template``). The methods mirror ``PreTrainedTokenizerFast`` for
what loom calls; ``tests/test_fast_tokenizer.py`` checks them against transformers.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer

__all__ = ["FastTokenizer", "compile_chat_template"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _content(token: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _read_chat_template(path: str, config: dict[str, Any]) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> Any:
    """Compile a chat template the way transformers does (sandboxed, trimmed blocks, its
    ``{% generation %}`` tag and helpers). Raises ``jinja2.TemplateSyntaxError``."""
    # lazy: jinja2 costs ~0.1 s of start-up in every process; only a chat template needs it
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks;
        # rendering keeps what it encloses.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class FastTokenizer:
    """Tokenizer of a directory with ``tokenizer.json``; see the module docstring."""

    def __init__(self, path: str) -> None:
        self.name_or_path = path
        self.backend_tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config_path = os.path.join(path, "tokenizer_config.json")
        config: dict[str, Any] = {}
        if os.path.isfile(config_path):
            with open(config_path) as f:
                config = json.load(f)
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.chat_template = _read_chat_template(path, config)
        self.special_tokens_map: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            token = _content(config.get(key))
            if token is not None:
                self.special_tokens_map[key] = token
        extra = [_content(t) for t in config.get("additional_special_tokens") or config.get("extra_special_tokens") or []]
        specials = {*self.special_tokens_map.values(), *(t for t in extra if t)}
        ids = (self.backend_tokenizer.token_to_id(t) for t in specials)
        # As in transformers: the ids of the named special tokens (decode() skips every
        # special added token, as the tokenizers library does).
        self.all_special_ids = sorted(i for i in ids if i is not None)
        self._special_ids = frozenset(self.all_special_ids)

    # ---- special tokens ------------------------------------------------------------
    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens_map.get(key)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    # ---- encode / decode -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        text = self.backend_tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids
                if not (skip_special_tokens and i in self._special_ids)]

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend_tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else "".join(tokens)

    # ---- chat ---------------------------------------------------------------------------
    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render ``conversation`` with the template (the tokenizer's, or ``chat_template``)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        text = compile_chat_template(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map, **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and contractions."""
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text
