"""CPU linear layers on oneDNN-prepacked weights (``loom.layers.onednn``) compute what F.linear does."""

from __future__ import annotations

import pytest
import torch
from loom import envs
from loom.layers import onednn
from loom.layers.linear import LinearBase
from loom.layers.logits_processor import LogitsProcessor
from loom.layers.vocab_parallel_embedding import ParallelLMHead
from loom.model_loader import get_model
from model_utils import make_config, run_prefill


@pytest.fixture(autouse=True)
def _live_envs():
    """Read LOOM_* as the test sets them: an in-process engine started by an earlier test froze them."""
    envs._disable_envs_cache_for_tests()


PROMPTS = [[5, 17, 900, 3, 42, 999, 0], list(range(100, 140))]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


# oneDNN's bf16 reorder needs AVX512 (bw, vl, dq) or AVX-NE-CONVERT; an AVX2-only CPU has neither
BF16_PACKS = {"avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags() or "avx_ne_convert" in _cpu_flags()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=True)),
        "opt": OPTForCausalLM(OPTConfig(  # biases everywhere
            vocab_size=1000, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, init_std=0.2, dropout=0.0)),
    }
    out = {}
    for name, model in models.items():
        out[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(out[name])
    return out


def _load(path: str, dtype: str, prepack: bool, monkeypatch) -> torch.nn.Module:
    monkeypatch.setenv("LOOM_CPU_PREPACK", "1" if prepack else "0")
    return get_model(make_config(path, dtype=dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "opt"])
def test_prepacked_model_equals_f_linear(name, dtype, model_dirs, monkeypatch):
    dense = _load(model_dirs[name], dtype, False, monkeypatch)
    packed = _load(model_dirs[name], dtype, True, monkeypatch)
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    packs = dtype == "float32" or BF16_PACKS  # elsewhere the bf16 weights stay dense (F.linear)
    assert linears and all(m.weight.is_mkldnn == packs for m in linears)
    assert not any(m.weight.is_mkldnn for m in dense.modules() if isinstance(m, LinearBase))
    assert (packed.logits_processor.packed_head is not None) == packs and dense.logits_processor.packed_head is None
    # state_dict() shows the dense weights, exactly the loaded ones
    want, got = dense.state_dict(), packed.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert not got[key].is_mkldnn and torch.equal(got[key], want[key]), key
    # the same logits: the same oneDNN GEMM in bf16, float rounding apart in fp32
    for a, b in zip(run_prefill(dense, PROMPTS), run_prefill(packed, PROMPTS)):
        tol = 1e-5 if dtype == "float32" else 2e-2
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_lm_head_skips_padding_rows(bias):
    """Vocabulary 1000 padded to 1024 rows, chunks of 96: the chunk holding row 1000 runs
    over padding, whose zero logits would win against the all-negative real ones."""
    torch.manual_seed(0)
    head = ParallelLMHead(1000, 24, bias=bias)
    assert head.weight.shape[0] == 1024
    with torch.no_grad():
        head.weight[:1000] = -torch.rand(1000, 24) - 0.1
        head.weight[1000:] = 0
        if bias:
            head.bias[:1000] = -torch.rand(1000)
    hidden = torch.rand(5, 24) + 0.1
    hidden[2] = 0  # all logits equal to the bias (or 0): ties go to the lowest id
    dense = LogitsProcessor(1000)
    want_logits = dense(head, hidden)
    want = want_logits.argmax(-1)
    packed = LogitsProcessor(1000)
    packed.chunk = 96
    packed.packed_head = onednn.PackedHead(head.weight, packed.chunk)
    assert [hi - lo for lo, hi, _ in packed.packed_head.chunks][-1] == 1024 - 10 * 96
    torch.testing.assert_close(packed(head, hidden), want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.greedy_token_ids(head, hidden), want)
    assert torch.equal(packed.greedy_token_ids(head, hidden, chunk=100), want)  # another chunking: dense path
    assert (want < 1000).all()


def test_prepack_off_keeps_f_linear(model_dirs, monkeypatch):
    model = _load(model_dirs["opt"], "float32", False, monkeypatch)
    assert onednn.prepack_model(model) == 0  # the switch holds for a second call too
    monkeypatch.setenv("LOOM_CPU_PREPACK", "1")
    assert onednn.prepack_model(model) > 0
    assert onednn.prepack_model(model) == 0  # already packed: nothing left to pack


def test_this_torch_packs():
    """The matrix's torch (x86 CPU wheel) has oneDNN: a torch without it fails here, not skips."""
    assert onednn.available()


def test_only_cpu_float32_and_bfloat16_are_packed():
    """oneDNN's fp16 GEMM needs AVX512-FP16: fp16 weights (a platform may allow them) stay dense;
    bf16 weights are packed where this CPU has the instructions oneDNN's bf16 reorder needs."""
    assert onednn.enabled_for(torch.zeros(4, 4))
    assert onednn.enabled_for(torch.zeros(4, 4, dtype=torch.bfloat16)) == BF16_PACKS
    assert not onednn.enabled_for(torch.zeros(4, 4, dtype=torch.float16))
    assert not onednn.enabled_for(torch.zeros(4, 4, device="meta"))
