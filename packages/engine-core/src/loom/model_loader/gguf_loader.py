"""Read llama-architecture GGUF files directly (``gguf`` package) and cache the conversion.

The first load of a GGUF file converts it once into
``<LOOM_CACHE_DIR>/gguf/<key>/``: ``config.json`` (a ``LlamaConfig``), the tokenizer
files and ``tensors.json`` (where each tensor lies in the file, for ``--quantization
gguf``, which maps the file itself). ``model.safetensors`` (dequantized fp32 tensors under
HF names, with llama.cpp's Q/K rotary permutation undone) is added the first time
``--quantization none`` loads the file. ``key`` hashes the file's absolute path, size and
mtime, so an edited file converts again. The directory and the weights file each appear
atomically (temp + rename) under a file lock, so concurrent processes write them once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from loom_plugin_api.tracing import span
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .. import envs
from ..logger import init_logger
from ..progress import progress_bar
from ..transformers_utils.config import HFConfig
from ..transformers_utils.fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = init_logger(__name__)

__all__ = [
    "ensure_gguf_cache",
    "get_gguf_tokenizer",
    "cached_gguf_entries",
    "dequantized",
    "gguf_cache_dir",
    "gguf_weights_file",
    "iterate_gguf_weights",
    "load_gguf_config",
    "reverse_permute",
]

# Bump when the cached layout or conversion changes: old caches are then ignored.
_CONVERTER_VERSION = "4"  # 4: fp32 weights on demand; 3: tensors.json (older caches stay until removed by hand)
_WEIGHTS_FILE = "model.safetensors"
_INDEX_FILE = "tensors.json"
_CACHE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", _INDEX_FILE)
"""What a converted cache always holds; the fp32 weights are written when first asked for."""

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's pre-tokenizer names).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


# ---- metadata ------------------------------------------------------------------------
class _Metadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: str) -> None:
        self.reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} has no {key!r} metadata; it is incomplete or not a model file")
        return value


def _open(path: str) -> _Metadata:
    # lazy: gguf costs start-up time, and a model converted once (cached) never opens the file again
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}; re-download it") from None
    return _Metadata(reader, path)


def _config_dict(meta: _Metadata) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"GGUF file {meta.path} has architecture {arch!r}; loom reads llama-architecture GGUF files "
            "(Llama, SmolLM2, TinyLlama, Mistral). Use the model's HF safetensors directory instead."
        )
    tensors = {t.name: t for t in meta.reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"GGUF file {meta.path} uses per-frequency rope factors (Llama 3.1 style), "
                         "which loom's GGUF reader does not support; use the HF safetensors model")
    hidden = int(meta.require("llama.embedding_length"))
    heads = int(meta.require("llama.attention.head_count"))
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError(f"GGUF file {meta.path} has a per-layer KV head count, which loom does not support")
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rotary_dim != head_dim:
        raise ValueError(f"GGUF file {meta.path} rotates {rotary_dim} of {head_dim} head channels; "
                         "partial rotary embeddings are not supported")
    tokens = meta.require("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    vocab_size = int(embd.shape[-1]) if embd is not None else len(tokens)  # ne order: (hidden, vocab)
    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta.require("llama.rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF file {meta.path} uses rope scaling {scaling_type!r}; loom supports linear only")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _make_hf_config(config: dict[str, Any]) -> PretrainedConfig:
    # lazy: transformers imports torch; only the one-time conversion needs it
    from transformers import LlamaConfig

    return LlamaConfig(**config)


# ---- weights -------------------------------------------------------------------------
def reverse_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rotary pairs -> NeoX halves).

    ``weights``: ``(n_head * head_dim, in)`` or a bias ``(n_head * head_dim,)``.
    """
    half = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, half, 2, *weights.shape[1:])  # (H, D/2, 2, ...)
    return w.swapaxes(1, 2).reshape(weights.shape)  # (H, 2, D/2, ...) -> rows


def _hf_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")  # suffix: weight / bias
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        mapped = _LAYER_NAMES.get(kind)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{suffix}"
    mapped = _TOP_NAMES.get(base)
    return None if mapped is None else f"{mapped}.{suffix}"


def _param_of(gguf_name: str, source: str, heads: int, kv_heads: int) -> tuple[str, int | None]:
    """The HF parameter a GGUF tensor loads into, and for Q and K (whose rows llama.cpp
    permuted, ``reverse_permute`` undoes it) their head count."""
    name = _hf_name(gguf_name)
    if name is None:
        raise ValueError(f"GGUF file {source} has tensor {gguf_name!r}, which loom cannot map to a Llama parameter")
    return name, heads if ".q_proj." in name else kv_heads if ".k_proj." in name else None


def dequantized(tensor: Any, type_name: str, shape: tuple[int, ...], n_head: int | None, source: str) -> np.ndarray:
    """A GGUF tensor (``GGUFReader``'s or the cache index's) as fp32 in HF order: Q8_0 and
    F32/F16 here (vectorized), other formats through the ``gguf`` package."""
    if type_name == "Q8_0" and len(shape) == 2:
        # lazy: it imports torch, and the processes that only tokenize import this module
        from .gguf_quant import dequantize_q8_0

        array = dequantize_q8_0(tensor.data.reshape(shape[0], -1))
    elif type_name in ("F32", "F16"):
        array = np.array(tensor.data, dtype=np.float32).reshape(shape)  # a writable copy of the map
    else:
        from gguf.quants import dequantize  # lazy: as GGUFReader in _open

        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ValueError(f"GGUF tensor {tensor.name} of {source} has quantization {type_name}, which the gguf "
                             "package cannot dequantize") from None
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
    return reverse_permute(array, n_head) if n_head is not None else array


def _gguf_tensors(meta: _Metadata, config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...], Any]]:
    """``(hf_name, shape, make_array)`` for each tensor, in file order, without dequantizing."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in meta.reader.tensors:
        name, n_head = _param_of(tensor.name, meta.path, heads, kv_heads)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ne order -> row-major

        def make(tensor: Any = tensor, shape: tuple[int, ...] = shape, n_head: int | None = n_head) -> np.ndarray:
            return dequantized(tensor, tensor.tensor_type.name, shape, n_head, meta.path)

        yield name, shape, make


class _IndexedTensor:
    """A tensor of a GGUF file found through the cache's ``tensors.json``: ``data`` is what
    ``GGUFReader`` gives (a view of the memory-mapped file: the element type for F32/F16,
    ``(rows, bytes per row)`` uint8 for block formats), without parsing the file's metadata
    and, for the formats loom reads itself, without importing ``gguf``."""

    _BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34)}  # weights, bytes per block

    def __init__(self, entry: dict[str, Any], mapped: np.ndarray) -> None:
        self.name, self.type_name = entry["name"], entry["type"]
        raw = mapped[entry["offset"]:entry["offset"] + entry["nbytes"]]
        rows = list(reversed(entry["ne"]))
        plain = {"F32": np.float32, "F16": np.float16}.get(self.type_name)
        if plain is not None:
            self.data = raw.view(plain).reshape(rows)
        else:
            block, nbytes = self._BLOCKS.get(self.type_name) or self._gguf_sizes()
            self.data = raw.reshape(*rows[:-1], rows[-1] // block * nbytes)

    def _gguf_sizes(self) -> tuple[int, int]:
        from gguf import GGML_QUANT_SIZES  # lazy: only for the formats the table above lacks

        return GGML_QUANT_SIZES[self.tensor_type]

    @property
    def tensor_type(self) -> Any:
        """``gguf.GGMLQuantizationType`` (imports ``gguf``), for ``gguf.quants.dequantize``."""
        from gguf import GGMLQuantizationType  # lazy: see _gguf_sizes

        return GGMLQuantizationType[self.type_name]


def cached_gguf_entries(path: str) -> list[tuple[str, tuple[int, ...], _IndexedTensor, int | None]]:
    """``(hf_name, shape, tensor, n_head)`` of each tensor of ``path``, from its conversion cache
    (converting it first if needed):
    the tensor index and the config are read from there, the data from a memory map of the
    file. Parsing a GGUF file's metadata (the tokenizer's 49k strings) takes seconds."""
    cache_dir = ensure_gguf_cache(path)
    with open(os.path.join(cache_dir, _INDEX_FILE)) as f:
        index = json.load(f)
    if not index["little_endian"]:
        raise ValueError(f"GGUF file {path} is big-endian; loom maps only little-endian files' tensors directly: "
                         "use --quantization none")
    with open(os.path.join(cache_dir, "config.json")) as f:
        config = json.load(f)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    entries = []
    for entry in index["tensors"]:
        name, n_head = _param_of(entry["name"], path, heads, kv_heads)
        entries.append((name, tuple(reversed(entry["ne"])), _IndexedTensor(entry, mapped), n_head))
    return entries


def iterate_gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` of every tensor of a llama GGUF file, Q/K un-permuted."""
    import torch  # lazy: the CLI, front end and engine core use this module without torch

    meta = _open(path)
    config = _config_dict(meta)
    for name, _, make in _gguf_tensors(meta, config):
        array = make()
        # F32 tensors are views of the read-only memory map; torch wants writable memory.
        yield name, torch.from_numpy(array if array.flags.writeable else array.copy())


def _write_safetensors(path: str, items: Iterable[tuple[str, tuple[int, ...], Any]]) -> None:
    """Write float32 tensors to a safetensors file one at a time (memory: one tensor)."""
    items = list(items)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "loom gguf conversion"}}
    offset = 0
    for name, shape, _ in items:
        nbytes = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        with progress_bar(len(items), "Dequantizing GGUF weights", "tensor") as bar:
            for name, shape, make in items:
                _write_tensor(f, name, shape, make())
                bar.update(1)


def _write_tensor(f: Any, name: str, shape: tuple[int, ...], array: np.ndarray) -> None:
    if tuple(array.shape) != shape:
        raise ValueError(f"GGUF tensor {name} dequantized to {array.shape}, expected {shape}")
    f.write(array.astype("<f4", copy=False).tobytes())


# ---- tokenizer -----------------------------------------------------------------------
def _pre_tokenizer(pre: str | None) -> Any:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _SPLIT_REGEX.get(pre or "")
    if split is not None:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre not in (None, "default", "gpt2", "gpt-2"):
        logger.warning("GGUF pre-tokenizer %r is not known to loom; splitting text the GPT-2 way", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _build_tokenizer(meta: _Metadata) -> PreTrainedTokenizerFast:
    # lazy: transformers imports torch; only the one-time conversion needs it
    from transformers import PreTrainedTokenizerFast

    model = meta.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF file {meta.path} has a {model!r} tokenizer; loom builds byte-level BPE ('gpt2') "
                         "tokenizers from GGUF. Pass --tokenizer with an HF tokenizer directory instead.")
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = token("bos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED])
    kwargs = {name: token(key) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                 ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    chat_template = meta.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{k: v for k, v in kwargs.items() if v is not None},
        chat_template=chat_template,
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        model_max_length=int(meta.get("llama.context_length", 2048)),
    )


# ---- the cache -----------------------------------------------------------------------
def gguf_cache_dir(path: str, cache_root: str | None = None) -> str:
    """Where the conversion of ``path`` lives (it may not exist yet)."""
    path = os.path.abspath(path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise FileNotFoundError(f"GGUF file {path} cannot be read: {e.strerror}") from None
    key = hashlib.sha256(f"{_CONVERTER_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(cache_root or envs.LOOM_CACHE_DIR, "gguf", key)


def gguf_weights_file(path: str, cache_root: str | None = None) -> str:
    """The fp32 safetensors of ``path``'s dequantized weights (``--quantization none``), written
    into its cache the first time they are asked for: ``--quantization gguf`` never reads them,
    and for a large file they are eight times its size."""
    cache_dir = ensure_gguf_cache(path, cache_root)
    weights = os.path.join(cache_dir, _WEIGHTS_FILE)
    if os.path.isfile(weights):
        return weights
    with _file_lock(cache_dir + ".weights.lock"):
        if os.path.isfile(weights):  # another process wrote them while we waited
            return weights
        start = time.perf_counter()
        meta = _open(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=cache_dir)
        os.close(fd)
        try:
            with span("dequantize GGUF weights to fp32", file=os.path.basename(path)):
                _write_safetensors(tmp, _gguf_tensors(meta, _config_dict(meta)))
            os.replace(tmp, weights)  # atomic: a reader sees no file or the whole file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        logger.info("Dequantized %s to fp32 in the loom cache in %.1f s", os.path.basename(path),
                    time.perf_counter() - start)
    return weights


def _is_complete(cache_dir: str) -> bool:
    return all(os.path.isfile(os.path.join(cache_dir, f)) for f in _CACHE_FILES)


@contextlib.contextmanager
def _file_lock(lock_path: str) -> Iterator[None]:
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_gguf_cache(path: str, cache_root: str | None = None) -> str:
    """Convert ``path`` into the cache unless that is done already; return the cache dir."""
    cache_dir = gguf_cache_dir(path, cache_root)
    if _is_complete(cache_dir):
        return cache_dir
    parent = os.path.dirname(cache_dir)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise OSError(f"cannot create the GGUF cache {parent}: {e.strerror}; set LOOM_CACHE_DIR to a writable "
                      "directory") from None
    with _file_lock(cache_dir + ".lock"):
        if _is_complete(cache_dir):  # another process converted it while we waited
            return cache_dir
        if os.path.isdir(cache_dir):  # left incomplete by hand or by an older loom
            shutil.rmtree(cache_dir)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
        try:
            with span("convert GGUF metadata and tokenizer", file=os.path.basename(path)):
                _convert(os.path.abspath(path), tmp)
            os.rename(tmp, cache_dir)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return cache_dir


def _convert(path: str, out_dir: str) -> None:
    start = time.perf_counter()
    logger.info("Converting GGUF file %s into the loom cache (once per file)", path)
    meta = _open(path)
    config = _config_dict(meta)
    _make_hf_config(config).save_pretrained(out_dir)
    _build_tokenizer(meta).save_pretrained(out_dir)
    index = {"little_endian": meta.reader.endianess.name == "LITTLE",
             "tensors": [{"name": t.name, "type": t.tensor_type.name, "ne": [int(d) for d in t.shape.tolist()],
                          "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in meta.reader.tensors]}
    with open(os.path.join(out_dir, _INDEX_FILE), "w") as f:
        json.dump(index, f)
    st = os.stat(path)
    with open(os.path.join(out_dir, "source.json"), "w") as f:
        json.dump({"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                   "converter_version": _CONVERTER_VERSION}, f)
    logger.info("Converted %s in %.1f s -> %s", os.path.basename(path), time.perf_counter() - start,
                os.path.dirname(out_dir))


def load_gguf_config(path: str, cache_root: str | None = None) -> HFConfig:
    """The config of a llama GGUF file (converting the file on first use)."""
    cache_dir = ensure_gguf_cache(path, cache_root)
    return HFConfig.from_json_file(os.path.join(cache_dir, "config.json"))


def get_gguf_tokenizer(path: str, cache_root: str | None = None) -> FastTokenizer:
    """The tokenizer described by a GGUF file's ``tokenizer.ggml.*`` metadata (cached), as
    loom loads it: ``FastTokenizer`` over the cached ``tokenizer.json``."""
    return FastTokenizer(ensure_gguf_cache(path, cache_root))
