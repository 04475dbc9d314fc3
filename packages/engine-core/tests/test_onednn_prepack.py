"""CPU linear layers on prepacked weights (``loom.layers.onednn``: oneDNN's layout, or loom's panels
on AVX2 CPUs) compute what F.linear does."""

from __future__ import annotations

import pytest
import torch
from loom import envs, platforms
from loom.layers import onednn
from loom.layers.linear import LinearBase
from loom.layers.logits_processor import LogitsProcessor
from loom.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
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
# fp32 layers hold panels for loom's own GEMM on AVX2 + FMA without AVX-512, bf16 ones on AVX512-BF16
# without AMX (test_cpu_gemm.py checks that the kernels compile there), under the CPU platform;
# oneDNN's layout elsewhere
PANELS = platforms.current_platform.is_cpu() and {"avx2", "fma"} <= _cpu_flags() and "avx512f" not in _cpu_flags()
PANELS_BF16 = (platforms.current_platform.is_cpu() and {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags()
               and "amx_bf16" not in _cpu_flags())


def _form(weight: torch.Tensor) -> str:
    return "panels" if weight.dim() == 3 else "onednn" if weight.is_mkldnn else "dense"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    models = {
        "llama": LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=True)),
        "llama-untied": LlamaForCausalLM(LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, tie_word_embeddings=False)),
        "opt": OPTForCausalLM(OPTConfig(  # biases everywhere; a tied head
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


def _embeddings(model: torch.nn.Module) -> list[VocabParallelEmbedding]:
    return [m for m in model.modules() if type(m) is VocabParallelEmbedding]


def _holds_data(weight: torch.Tensor) -> bool:
    return weight.untyped_storage().nbytes() >= weight.numel() * weight.element_size()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["llama", "llama-untied", "opt"])
def test_prepacked_model_equals_f_linear(name, dtype, model_dirs, monkeypatch):
    dense = _load(model_dirs[name], dtype, False, monkeypatch)
    packed = _load(model_dirs[name], dtype, True, monkeypatch)
    linears = [m for m in packed.modules() if isinstance(m, LinearBase)]
    packs = dtype == "float32" or BF16_PACKS  # elsewhere the bf16 weights stay dense (F.linear)
    form = "panels" if (PANELS if dtype == "float32" else PANELS_BF16) else "onednn" if packs else "dense"
    assert linears and all(_form(m.weight) == form for m in linears)
    assert all(_form(m.weight) == "dense" for m in dense.modules() if isinstance(m, LinearBase))
    assert (packed.logits_processor.packed_head is not None) == packs and dense.logits_processor.packed_head is None
    # the LM head's dense weight is gone once packed; a tied embedding then reads the packed rows,
    # every one of them (padding too) exactly as the dense table holds it
    assert _holds_data(packed.lm_head.weight) != packs
    [embedding], [dense_embedding] = _embeddings(packed), _embeddings(dense)
    tied = name != "llama-untied"
    assert (embedding.row_source is not None) == (packs and tied) and dense_embedding.row_source is None
    assert _holds_data(embedding.weight) != (packs and tied)
    ids = torch.arange(embedding.weight.shape[0]).flip(0).reshape(8, -1)
    assert torch.equal(embedding(ids), dense_embedding.weight[ids])
    # the LM head without its dense weight: logits, and greedy ids in any chunking, from the packed one
    hidden = torch.randn(5, 64).to(packed.lm_head.weight.dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    torch.testing.assert_close(packed.compute_logits(hidden), dense.compute_logits(hidden), atol=tol, rtol=tol)
    want = dense.logits_processor.greedy_token_ids(dense.lm_head, hidden, chunk=100)
    greedy = packed.logits_processor.greedy_token_ids
    assert torch.equal(greedy(packed.lm_head, hidden, chunk=100), want) and torch.equal(greedy(packed.lm_head, hidden), want)
    # state_dict() shows the dense weights, exactly the loaded ones
    want, got = dense.state_dict(), packed.state_dict()
    assert want.keys() == got.keys()
    for key in want:
        assert _form(got[key]) == "dense", key
        assert torch.equal(got[key], want[key]), key
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
    assert packed.packed_head.panels == PANELS  # (fp32: loom's panels on AVX2 CPUs)
    assert [hi - lo for lo, hi, _ in packed.packed_head.chunks][-1] == 1024 - 10 * 96
    torch.testing.assert_close(packed(head, hidden), want_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed.greedy_token_ids(head, hidden), want)
    assert torch.equal(packed.greedy_token_ids(head, hidden, chunk=100), want)  # another chunking asked: the same ids
    assert (want < 1000).all()


@pytest.mark.parametrize("panel_gemm", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32] + [torch.bfloat16] * BF16_PACKS)  # the dtypes packed here
def test_packed_head_looks_rows_up(dtype, panel_gemm, monkeypatch):
    """1000 rows (padded to 1024) in chunks of 96: lookups across chunks, of the last short chunk
    and of padding give the dense rows bit for bit, in the ids' shape; an id past the table raises.
    In loom's panels (fp32 on AVX2 CPUs, bf16 on AVX512-BF16 ones) and in oneDNN's layout."""
    monkeypatch.setenv("LOOM_CPU_PANEL_GEMM", panel_gemm)
    torch.manual_seed(0)
    weight = torch.randn(1024, 40).to(dtype)
    weight[1000:] = 0
    head = onednn.PackedHead(weight, 96)
    assert head.panels == ((PANELS if dtype == torch.float32 else PANELS_BF16) and panel_gemm == "1")
    assert all((w.dim() == 3) == head.panels and w.is_mkldnn != head.panels for _, _, w in head.chunks)
    assert head.enable_lookup()
    ids = torch.tensor([[0, 95, 96, 1023], [999, 1000, 5, 960]])
    assert torch.equal(head.lookup(ids), weight[ids])
    assert torch.equal(head.lookup(torch.arange(1024)), weight) and torch.equal(head.to_dense(), weight)
    assert head.lookup(torch.tensor([], dtype=torch.int64)).shape == (0, 40)
    with pytest.raises(IndexError, match="1024 rows"):
        head.lookup(torch.tensor([3, 1024]))
    with pytest.raises(IndexError):
        head.lookup(torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="integers"):
        head.lookup(torch.tensor([1.0]))
    ids = torch.tensor([[7, 990]], dtype=torch.int32)
    assert torch.equal(head.lookup(ids), weight[ids.long()])


def test_row_layout_reads_column_pairs(monkeypatch):
    """oneDNN's bf16 layouts keep columns in adjacent pairs, 64 rows side by side (its
    ``OI16i64o2i`` and ``OI8i64o2i``); this CPU packs no bf16, so the fp32 buffer is laid out that
    way here, and the layout read back says so: groups of 2 at a column stride of 128."""
    offset, stride, group = onednn.row_layout(96, 40, torch.float32)
    assert (stride, group) == (64, 1)
    o, i = torch.arange(96)[:, None], torch.arange(40)
    fp32_at = (offset[:, None] + i * stride).flatten()
    pairs_at = (o // 64 * 64 * 40 + i // 2 * 128 + o % 64 * 2 + i % 2).flatten()
    real = onednn._buffer

    def in_pairs(packed):
        buffer = real(packed)
        out = torch.zeros_like(buffer)
        out[pairs_at] = buffer[fp32_at]
        return out

    onednn.row_layout.cache_clear()
    monkeypatch.setattr(onednn, "_buffer", in_pairs)
    offset, stride, group = onednn.row_layout(96, 40, torch.float32)
    assert (stride, group) == (128, 2) and torch.equal(offset, (o // 64 * 64 * 40 + o % 64 * 2).flatten())
    monkeypatch.undo()
    onednn.row_layout.cache_clear()


def test_row_layout_refuses_what_it_cannot_express(monkeypatch):
    """The layout is read back, not assumed: a buffer whose rows are not at one column stride
    from a per-row offset, or one that repeats an element, gives None (the dense table stays)."""
    assert onednn.row_layout(96, 40, torch.float32) is not None
    real = onednn._buffer
    onednn.row_layout.cache_clear()
    size = real(onednn.pack_weight(torch.zeros(96, 40))).numel()
    shuffle = torch.randperm(size, generator=torch.Generator().manual_seed(0))  # the same in every probe
    monkeypatch.setattr(onednn, "_buffer", lambda p: real(p)[shuffle])
    assert onednn.row_layout(96, 40, torch.float32) is None  # every element once, but scattered
    onednn.row_layout.cache_clear()
    monkeypatch.setattr(onednn, "_buffer", lambda p: torch.cat([real(p)[:1], real(p)[:-1]]))
    assert onednn.row_layout(96, 40, torch.float32) is None  # the first element twice, the last lost
    monkeypatch.undo()
    onednn.row_layout.cache_clear()


def test_chunks_of_different_layouts_are_not_looked_up_in(monkeypatch):
    """The kernel takes one column stride and group for all chunks: a last chunk laid out
    otherwise leaves the lookup off (and the embedding its dense table). (oneDNN's layouts: a
    head in panels, whole panels each chunk, has one known layout.)"""
    monkeypatch.setenv("LOOM_CPU_PANEL_GEMM", "0")
    real = onednn.row_layout
    monkeypatch.setattr(onednn, "row_layout", lambda r, c, d: real(r, c, d)[:1] + ((64, 1) if r == 96 else (32, 1)))
    assert not onednn.PackedHead(torch.randn(100, 40), 96).enable_lookup()
    assert onednn.PackedHead(torch.randn(96 * 2, 40), 96).enable_lookup()


def test_tied_embedding_stays_dense_without_the_kernels(model_dirs, monkeypatch):
    """No compiled kernels (no C compiler): the LM head is still packed, and its untied dense
    weight still goes, but a tied embedding keeps its table, which it reads with F.embedding."""
    from loom.platforms import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "kernels", lambda: None)
    for name, tied in (("llama", True), ("llama-untied", False)):
        model = _load(model_dirs[name], "float32", True, monkeypatch)
        [embedding] = _embeddings(model)
        assert model.logits_processor.packed_head is not None and _holds_data(model.lm_head.weight) == tied
        assert embedding.row_source is None and _holds_data(embedding.weight)


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


@pytest.mark.parametrize("bias", [False, True])
def test_many_fp32_rows_go_through_blas_on_a_dense_copy(bias, monkeypatch):
    """Where ``blas_for_many_rows`` says so, fp32 inputs of ``DENSE_ROWS`` rows or more (a prefill
    step's) multiply through F.linear on the packed weight's dense copy; fewer rows, bf16, or a
    CPU where it says no stay on oneDNN. Both roads give F.linear's result."""
    torch.manual_seed(0)
    weight = torch.randn(96, 40)
    b = torch.randn(96) if bias else None
    packed = onednn.pack_weight(weight)
    blas_calls = []
    f_linear = torch.nn.functional.linear

    def spy(x, w, bias=None):
        blas_calls.append((x.shape[:-1], w.is_mkldnn))
        return f_linear(x, w, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    rows = onednn.DENSE_ROWS
    for here, shape, calls in [(True, (rows, 40), [((rows,), False)]), (True, (2, rows // 2, 40), [((2, rows // 2), False)]),
                               (True, (rows - 1, 40), []), (False, (rows * 2, 40), [])]:
        monkeypatch.setattr(onednn, "_blas_here", lambda here=here: here)
        blas_calls.clear()
        x = torch.randn(*shape)
        got = onednn.linear(x, packed, b)
        assert blas_calls == calls, (here, shape)
        torch.testing.assert_close(got, f_linear(x, weight, b), atol=1e-4, rtol=1e-5)
    if BF16_PACKS:  # bf16 is oneDNN's own GEMM either way: never copied
        monkeypatch.setattr(onednn, "_blas_here", lambda: True)
        blas_calls.clear()
        onednn.linear(torch.randn(rows, 40, dtype=torch.bfloat16), onednn.pack_weight(weight.bfloat16()), None)
        assert blas_calls == []


def test_blas_for_many_rows_only_on_avx2_without_avx512():
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert onednn.blas_for_many_rows(avx2, mkl=True)
    assert not onednn.blas_for_many_rows(avx2, mkl=False)  # a torch without MKL: its BLAS not measured
    assert not onednn.blas_for_many_rows(avx2 | {"avx512f", "avx512bw"}, mkl=True)
    assert not onednn.blas_for_many_rows(frozenset({"sse4_2", "avx"}), mkl=True)
    assert not onednn.blas_for_many_rows(frozenset(), mkl=True)  # not x86 (no flags line)
