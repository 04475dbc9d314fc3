"""ModelConfig: which model, in which format and dtype, and its resolved architecture."""

from __future__ import annotations

import os
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

from loom_plugin_api import (
    GENERAL_PLUGINS_GROUP,
    ModelInfo,
    ModelRegistry,
    ModelRegistryError,
    plugin_records,
)

from ..logger import init_logger
from ..platforms.cpu_features import native_bf16
from ..transformers_utils.config import get_hf_config, resolve_model_path

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

# Accepted spellings -> torch's name. The config keeps the name: the processes of a serve
# that never compute read it without importing torch.
_DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "half": "float16", "fp16": "float16",
}


QUANTIZATIONS = ("auto", "gguf", "int4", "int8", "none")
QUANT_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    model: str | None
    """A directory of HF-format safetensors, a .gguf file, or None for the embedded default."""
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    """``auto``, a dtype name or a ``torch.dtype``; resolved to a name (``float32``, ...)."""
    max_model_len: int | None = None
    quantization: str = "auto"
    """How linear weights are held (``layers/quantized.py``): ``gguf`` keeps a GGUF file's blocks
    (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) as they are; ``int4`` / ``int8`` quantize a safetensors checkpoint's linear
    weights at load (round to nearest, groups of ``quantization_group_size``); ``none`` keeps or
    dequantizes every weight to ``dtype``; ``auto`` is ``gguf`` for a GGUF file on the CPU in
    bfloat16, else ``none``."""
    quantization_group_size: int = 128
    """Weights per scale along the input dimension for ``int4`` / ``int8`` (GGUF files keep theirs)."""
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int | None = 0
    served_model_name: str | None = None
    device_type: InitVar[str | None] = None
    """The platform's ``device_type``: ``auto`` follows the CPU's bf16 support on ``"cpu"``."""
    platform_dtypes: InitVar[tuple[str, ...] | None] = None
    """The platform's ``supported_dtypes``: ``auto`` on the host picks bf16 only if listed."""
    # resolved in __post_init__
    model_path: str = field(init=False)
    model_format: str = field(init=False)
    hf_config: Any = field(init=False)
    architecture: str = field(init=False)
    model_info: ModelInfo = field(init=False)

    def __post_init__(self, device_type: str | None, platform_dtypes: tuple[str, ...] | None) -> None:
        self.model_path, self.model_format = resolve_model_path(self.model)
        if self.served_model_name is None:
            self.served_model_name = default_served_name(self.model)
        self.hf_config = get_hf_config(self.model_path, self.model_format)
        if not isinstance(self.hf_overrides, dict):
            raise ValueError(f"--hf-overrides must be a JSON object, got {self.hf_overrides!r}")
        for key, value in self.hf_overrides.items():
            setattr(self.hf_config, key, value)
        self.dtype = self._resolve_dtype(self.dtype, device_type, platform_dtypes)
        self.quantization = self._resolve_quantization(self.quantization, device_type)
        architectures = list(getattr(self.hf_config, "architectures", None) or [])
        if not architectures:
            raise ValueError(
                f"{self.model_path} has no 'architectures' in its config; name one with "
                "--hf-overrides '{\"architectures\": [\"LlamaForCausalLM\"]}'"
            )
        try:
            self.model_info, self.architecture = ModelRegistry.inspect_model_cls(architectures, self)
        except ModelRegistryError as e:
            loaded = [r.name for r in plugin_records(GENERAL_PLUGINS_GROUP) if r.status == "loaded"]
            raise ValueError(
                f"{e}. General plugins loaded: {', '.join(loaded) or '(none)'}. Install the plugin "
                "that provides the architecture, or rename it with --hf-overrides."
            ) from None
        logger.info("Resolved architecture: %s", self.architecture)
        derived = self._derived_max_model_len()
        if self.max_model_len is None:
            self.max_model_len = derived
        elif self.max_model_len > derived:
            raise ValueError(
                f"--max-model-len {self.max_model_len} exceeds the model's context length {derived}; "
                f"lower --max-model-len to at most {derived}"
            )
        elif self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype`` (imports torch; for the processes that compute)."""
        import torch  # here, not at the top: the processes that never compute read the config too

        return getattr(torch, str(self.dtype))

    def _resolve_dtype(self, dtype: Any, device_type: str | None, platform_dtypes: tuple[str, ...] | None) -> str:
        if not isinstance(dtype, str):  # a torch.dtype, e.g. LLM(dtype=torch.bfloat16)
            dtype = str(dtype).removeprefix("torch.")
        if dtype != "auto":
            if dtype not in _DTYPES:
                raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
            return _DTYPES[dtype]
        raw = getattr(self.hf_config, "dtype", None)
        config_dtype = _DTYPES.get(str(raw).removeprefix("torch.")) if raw is not None else "float32"
        gguf = self.model_format == "gguf"
        source = "the checkpoint is GGUF" if gguf else f"the checkpoint's dtype is {raw or 'unset (float32)'}"
        if device_type == "cpu":
            dtype, why = self._host_auto(config_dtype, source, platform_dtypes)
        else:  # other devices: the checkpoint's fp32 or bf16; quantized GGUF weights dequantize to fp32
            dtype = config_dtype if config_dtype in ("float32", "bfloat16") and not gguf else "float32"
            why = f"{source}; on {device_type}, auto keeps an fp32 or bf16 checkpoint's dtype, else fp32"
        logger.info("dtype auto resolved to %s: %s", dtype, why)
        return dtype

    def _host_auto(self, config_dtype: str | None, source: str,
                   platform_dtypes: tuple[str, ...] | None) -> tuple[str, str]:
        """``auto`` on a platform that computes on the host, and why: bf16 where the CPU computes
        it natively (``avx512_bf16`` / ``amx_bf16``, as vLLM) and the checkpoint is a 16/32-bit
        float or GGUF, else fp32. Resolved once, where the config is built, without torch."""
        bf16, why = native_bf16()
        if not bf16:
            return "float32", why
        if config_dtype is None and self.model_format != "gguf":
            return "float32", f"{why}, but {source}, not a 16/32-bit float"
        if platform_dtypes is not None and "bfloat16" not in platform_dtypes:
            return "float32", f"{why}, but the platform does not declare bfloat16"
        return "bfloat16", f"{why} and {source}"

    def _resolve_quantization(self, quantization: str, device_type: str | None) -> str:
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        gguf, host = self.model_format == "gguf", device_type in (None, "cpu")
        if quantization == "auto":
            resolved = "gguf" if gguf and host and self.dtype == "bfloat16" else "none"
            logger.info("quantization auto resolved to %s", resolved)
            return resolved
        if quantization == "gguf" and not gguf:
            raise ValueError(f"--quantization gguf keeps a GGUF file's blocks, but {self.model_path} is not a GGUF "
                             "file; use --quantization none (or auto)")
        if quantization in ("int4", "int8") and gguf:
            raise ValueError(f"--quantization {quantization} quantizes a safetensors checkpoint, but {self.model_path} "
                             "is a GGUF file, already quantized; use --quantization gguf (or auto)")
        if quantization != "none" and not host:
            raise ValueError(f"--quantization {quantization} runs on the CPU platform only so far, not on "
                             f"{device_type}; use --quantization none (or auto)")
        if self.quantization_group_size not in QUANT_GROUP_SIZES:
            raise ValueError(f"--quantization-group-size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, "
                             f"got {self.quantization_group_size}")
        return quantization

    def _derived_max_model_len(self) -> int:
        for key in ("max_position_embeddings", "n_positions", "max_seq_len"):
            value = getattr(self.hf_config, key, None)
            if value:
                return int(value)
        return 2048

    # ---- shape helpers used by workers and the engine ---------------------------------
    def get_hidden_size(self) -> int:
        return int(self.hf_config.hidden_size)

    def get_num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    def get_num_attention_heads(self) -> int:
        return int(self.hf_config.num_attention_heads)

    def get_num_kv_heads(self) -> int:
        return int(getattr(self.hf_config, "num_key_value_heads", None) or self.get_num_attention_heads())

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return int(head_dim or self.get_hidden_size() // self.get_num_attention_heads())

    def get_vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


def default_served_name(model: str | None) -> str:
    """The name clients see when ``--served-model-name`` is not given: the model directory's or
    GGUF file's own name, never the path to it (where a server keeps its files is not the
    clients' business; ``--served-model-name PATH`` shows a path on purpose)."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    name = os.path.basename(os.path.normpath(os.path.expanduser(model)))
    return name.removesuffix(".gguf") or model
