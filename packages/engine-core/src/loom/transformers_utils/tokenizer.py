"""``get_tokenizer``: the model's tokenizer, from an HF directory or a GGUF file's metadata.

A directory with ``tokenizer.json`` gets loom's torch-free ``FastTokenizer``; others (a
SentencePiece ``tokenizer.model`` only, say) go through ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..config import ModelConfig

__all__ = ["get_tokenizer"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def _from_hf_dir(path: str) -> PreTrainedTokenizerBase:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} is not a directory; pass --tokenizer with an HF "
                                "tokenizer directory")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:2])}, ...); save the tokenizer there "
            "with tokenizer.save_pretrained() or pass --tokenizer with a directory that has one"
        )
    try:
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return FastTokenizer(path)
        # lazy: transformers imports torch; only a tokenizer without tokenizer.json needs it
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # tokenizers raises a plain Exception for a malformed tokenizer.json
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e


def get_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """``model_config.tokenizer`` when set, else the model's own (HF dir or GGUF metadata)."""
    if model_config.tokenizer:
        return _from_hf_dir(os.path.abspath(os.path.expanduser(model_config.tokenizer)))
    if model_config.model_format == "gguf":
        # lazy: gguf_loader imports numpy and gguf, which only a GGUF model needs
        from ..model_loader.gguf_loader import get_gguf_tokenizer

        return get_gguf_tokenizer(model_config.model_path)
    return _from_hf_dir(model_config.model_path)
