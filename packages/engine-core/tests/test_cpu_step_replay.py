"""A captured decode step (loom.worker.cpu_step_replay) replays to the eager answer."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn as nn
from loom import envs, platforms
from loom.layers import onednn
from loom.layers.attention import Attention
from loom.layers.linear import LinearBase
from loom.model_loader import get_model
from loom.platforms import cpu_features, cpu_kernels, cpu_qdot
from loom.worker import cpu_step_replay
from loom.worker.cpu_step_replay import StepGraph, StepReplayError
from loom_plugin_api import AttentionMetadata, custom_op
from loom_plugin_api.context import set_forward_context
from model_utils import ModelRunnerHarness, make_config

CPU = platforms.current_platform.is_cpu()
"""Under another platform (the dummy session) the model runs that platform's ops and attention,
none of them a compiled kernel: capture is refused, which the model tests check instead."""

PANELS = CPU and onednn.panels_for(torch.float32, cpu_features.cpu_flags())
"""Where the fp32 linears run in loom's own GEMM (``platforms/cpu_gemm.c``) unless told not to."""
MAX_BLOCKS = 12
BLOCK = 4  # small blocks: the decode steps below cross several block boundaries


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield from _llama(tmp_path_factory, panel_gemm=True)


@pytest.fixture(scope="module")
def llama_onednn(tmp_path_factory):
    """The same model with its fp32 linears on oneDNN where loom's own GEMM would run them."""
    yield from _llama(tmp_path_factory, panel_gemm=False)


def _llama(tmp_path_factory, panel_gemm: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    envs._disable_envs_cache_for_tests()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.2, rope_theta=1000.0, tie_word_embeddings=CPU)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).float().save_pretrained(path)
    saved = dict(custom_op.kernel_registry)
    assert cpu_kernels.install()  # RMSNorm, SiLU-and-mul, rotary through the C kernels, as in a CPU worker
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOM_CPU_PANEL_GEMM", "1" if panel_gemm else "0")
        model = get_model(make_config(str(path)))
    # on the CPU platform tied and packed, as the default model is: the embedding's rows come from
    # the packed LM head through a compiled kernel, whose calls a replay makes again with the new
    # tokens. Untied elsewhere (the dummy session): its step then calls no compiled kernel at all,
    # and the tests check that capture is refused.
    assert (model.model.embed_tokens.row_source is not None) == CPU
    yield model
    custom_op.kernel_registry.clear()
    custom_op.kernel_registry.update(saved)


def _in_use(md: AttentionMetadata) -> AttentionMetadata:
    """The harness passes every block a request may use; the engine, those it holds."""
    md.block_tables = md.block_tables[:, : -(-max(md.seq_lens_list) // BLOCK)]
    return md


def _eager(model, ids, pos, md):
    with set_forward_context(md):
        return model(ids, pos).clone()


@pytest.mark.parametrize("gemm", ["loom's own where it runs", "oneDNN"])
@pytest.mark.parametrize("prompts", [[[7, 250, 3, 99, 41]], [[7, 250, 3, 99, 41], [5], [9, 8, 7, 6, 5, 4, 3, 2, 1]]])
@torch.inference_mode()
def test_replayed_steps_equal_eager_steps(request, prompts, gemm):
    """Capture the first decode step (one request, or a batch of three with different contexts),
    then for 20 more (new tokens, positions, slots, context lengths, block tables that grow) the
    replay gives the eager step's hidden states exactly and writes the K/V caches as it does;
    with the fp32 linears in loom's own GEMM (AVX2 CPUs) and in oneDNN."""
    llama = request.getfixturevalue("llama" if gemm != "oneDNN" else "llama_onednn")
    batch = len(prompts)
    h = ModelRunnerHarness(llama, block_size=BLOCK, max_blocks_per_req=MAX_BLOCKS, max_reqs=batch)
    logits = h.step(dict(enumerate(prompts)))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1

    def next_tokens(logits: torch.Tensor) -> dict[int, list[int]]:
        return {r: [int(t)] for r, t in enumerate(logits.argmax(-1).tolist())}

    ids, pos, md = h.build_metadata(next_tokens(logits[ends]))
    graph, hidden, why, _ = StepGraph.capture(llama, ids, pos, md, MAX_BLOCKS)
    if not CPU:
        assert graph is None and "no compiled kernel" in why, why
        return
    assert graph is not None, why
    assert graph.num_ops > 0 and graph.batch == batch and graph.nbytes > 0
    for _ in range(20):
        ids, pos, md = h.build_metadata(next_tokens(llama.compute_logits(hidden)))
        md = _in_use(md)
        assert graph.fits(md)
        caches = [m.kv_cache for m in llama.modules() if isinstance(m, Attention)]
        before = [c.clone() for c in caches]
        want = _eager(llama, ids, pos, md)  # writes this token's K/V
        after = [c.clone() for c in caches]
        for c, b in zip(caches, before):
            c.copy_(b)
        hidden = graph.replay(ids, pos, md)
        assert torch.equal(hidden, want)
        assert all(torch.equal(c, a) for c, a in zip(caches, after)), "the replay wrote K/V elsewhere"
    assert h.seq_lens[0] > 4 * BLOCK  # the context crossed several blocks
    # every compiled-kernel call (paged decode: 17 integer arguments and a float) went through tape_run
    tapes = [fn for fn, _ in graph._runs if isinstance(fn, cpu_step_replay._Tape)]
    assert sum(t._n for t in tapes) == sum(isinstance(fn, ctypes._CFuncPtr) for fn, _ in graph._ops) > 0
    assert not any(isinstance(fn, ctypes._CFuncPtr) for fn, _ in graph._runs)
    linears = [m for m in llama.modules() if isinstance(m, LinearBase)]
    assert all(m.weight.dim() == 3 for m in linears) == (gemm != "oneDNN" and PANELS)
    if gemm != "oneDNN" and PANELS:
        # loom's fp32 GEMM (AVX2 CPUs): each linear layer is one more call on the tape
        calls = [fn for fn, _ in graph._ops if getattr(fn, "__name__", "") == "panel_linear_f32"]
        assert len(calls) == len(linears) == 4 * 2
    else:
        # oneDNN's: the linear layers' results, which only kernels read, were not copied into captured buffers
        assert sum(fn is cpu_step_replay._again_repointed for fn, _ in graph._runs) >= 4 * 2


@torch.inference_mode()
def test_a_kernel_that_fails_in_the_tape_is_named(llama):
    """A kernel's error code inside tape_run (rotary: a position past its cache) stops the replay
    with a StepReplayError naming that kernel; the step is not taken as done."""
    h = ModelRunnerHarness(llama, block_size=BLOCK, max_blocks_per_req=MAX_BLOCKS, max_reqs=1)
    h.step({0: [7, 250, 3]})
    ids, pos, md = h.build_metadata({0: [5]})
    graph, _, why, _ = StepGraph.capture(llama, ids, pos, md, MAX_BLOCKS)
    if not CPU:
        assert graph is None and "no compiled kernel" in why, why
        return
    assert graph is not None, why
    with pytest.raises(StepReplayError, match="rotary"):
        graph.replay(ids, torch.full_like(pos, 10_000), _in_use(md))


@torch.inference_mode()
def test_a_capture_stops_where_its_buffers_pass_max_bytes(llama):
    """``nbytes`` counts the static inputs with what the step allocates; one byte more than a
    capture may keep refuses it as too large (and only that refusal says so), while the step's
    answer is the eager one either way."""
    h = ModelRunnerHarness(llama, block_size=BLOCK, max_blocks_per_req=MAX_BLOCKS, max_reqs=2)
    h.step({0: [7, 250, 3], 1: [5, 6]})
    ids, pos, md = h.build_metadata({0: [5], 1: [9]})
    md = _in_use(md)
    graph, _, why, too_large = StepGraph.capture(llama, ids, pos, md, MAX_BLOCKS)
    if not CPU:
        assert graph is None and "no compiled kernel" in why and not too_large, why
        return
    assert graph is not None and not too_large, why
    inputs = sum(t.untyped_storage().nbytes() for t in graph._inputs.values())
    assert graph.nbytes > inputs
    want = _eager(llama, ids, pos, md)
    exact = StepGraph.capture(llama, ids, pos, md, MAX_BLOCKS, max_bytes=graph.nbytes)
    assert exact.graph is not None and exact.graph.nbytes == graph.nbytes and not exact.too_large
    for limit in (graph.nbytes - 1, inputs - 1):  # the step's buffers, then its inputs alone, pass it
        over = StepGraph.capture(llama, ids, pos, md, MAX_BLOCKS, max_bytes=limit)
        assert over.graph is None and over.too_large and "exceed" in over.why, over.why
        assert torch.equal(over.output, want)


def test_only_calls_tape_run_can_make_are_taped():
    """``tape_run`` passes 20 integer-class arguments and one float: a call with more, with a
    double, or not into a compiled kernel stays a Python call."""
    k = cpu_kernels.kernels()
    assert k is not None, "the CPU kernels did not build: the tests need a C compiler with OpenMP"
    fn = k.tape_run  # any compiled function: only its argtypes matter to the encoding
    ok = cpu_step_replay._tape_op(fn, (1, 2, 3))
    assert ok is not None and list(ok.a[:3]) == [1, 2, 3] and ok.fn == ctypes.cast(fn, ctypes.c_void_p).value
    wide = type(fn)(ctypes.cast(fn, ctypes.c_void_p).value)
    wide.argtypes = [ctypes.c_int64] * 21
    assert cpu_step_replay._tape_op(wide, tuple(range(21))) is None
    wide.argtypes = [ctypes.c_int64] * 20 + [ctypes.c_float]
    assert cpu_step_replay._tape_op(wide, (*range(20), 0.5)).f == 0.5
    wide.argtypes = [ctypes.c_float, ctypes.c_float]
    assert cpu_step_replay._tape_op(wide, (0.5, 0.5)) is None
    wide.argtypes = [ctypes.c_double]
    assert cpu_step_replay._tape_op(wide, (0.5,)) is None
    assert cpu_step_replay._tape_op(lambda *a: 0, (1,)) is None
    wide.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    assert list(cpu_step_replay._tape_op(wide, (None, 7)).a[:2]) == [0, 7]  # a null pointer
    assert cpu_step_replay._tape_op(wide, (1, 1 << 63)) is None  # not an int64
    assert cpu_step_replay._tape_op(wide, (1, 2.0)) is None  # not a plain int
    wide.restype = ctypes.c_int64  # tape_run reads an int's return
    assert cpu_step_replay._tape_op(wide, (1, 2)) is None


@torch.inference_mode()
def test_a_step_that_does_not_fit_is_told_apart(llama):
    h = ModelRunnerHarness(llama, block_size=BLOCK, max_blocks_per_req=MAX_BLOCKS, max_reqs=2)
    h.step({0: [1, 2, 3], 1: [4, 5]})
    ids, pos, md = h.build_metadata({0: [6]})  # 4 tokens: one block
    graph, _, why, _ = StepGraph.capture(llama, ids, pos, _in_use(md), 2)
    if not CPU:
        assert graph is None and "no compiled kernel" in why, why
        return
    assert graph is not None, why
    assert graph.fits(_in_use(h.build_metadata({0: [7]})[2]))  # 5 tokens: two blocks
    assert not graph.fits(_in_use(h.build_metadata({0: [8], 1: [9]})[2]))  # two requests
    for token in range(10, 13):
        md = _in_use(h.build_metadata({0: [token]})[2])
    assert not graph.fits(md)  # 9 tokens: three blocks, more than the capture's table holds
    with pytest.raises(ValueError, match="block table"):
        StepGraph.capture(llama, ids, pos, md, 2)


def _metadata() -> AttentionMetadata:
    one = torch.ones(1, dtype=torch.int64)
    return AttentionMetadata(num_reqs=1, num_tokens=1, query_start_loc=torch.tensor([0, 1]), seq_lens=one,
                             query_lens=[1], seq_lens_list=[1], max_query_len=1, max_seq_len=1,
                             block_tables=torch.zeros(1, 1, dtype=torch.int64), slot_mapping=one, block_size=16)


class _KernelAndTorch(nn.Module):
    """An embedding (torch), the C RMSNorm kernel, then a torch op on positions."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.weight = nn.Parameter(torch.rand(32) + 0.5, requires_grad=False)
        self.kernels = cpu_kernels.kernels()  # built (and self-checked, with random inputs) before any capture

    def forward(self, ids, pos):
        x = self.kernels.rms_norm(self.embed(ids), self.weight, 1e-6)
        return x * pos.unsqueeze(-1).float()


@torch.inference_mode()
def test_kernels_and_torch_ops_replay_in_order():
    torch.manual_seed(0)
    model = _KernelAndTorch()
    md = _metadata()
    graph, _, why, _ = StepGraph.capture(model, torch.tensor([3]), torch.tensor([2]), md, 1)
    assert graph is not None, why
    for tok, p in ((17, 5), (49, 9)):
        ids, pos = torch.tensor([tok]), torch.tensor([p])
        assert torch.equal(graph.replay(ids, pos, md), model(ids, pos))
    assert any(isinstance(fn, cpu_step_replay._Tape) for fn, _ in graph._runs)  # RMSNorm's eps: the float


class _LinearsIntoKernels(nn.Module):
    """Linear layers: one whose result only the RMSNorm kernel reads (half of it, through a view
    at an offset), one whose result the kernel and a torch op read, one that is the step's output."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed, self.a, self.b, self.c = (nn.Embedding(64, 32), nn.Linear(32, 64, bias=False),
                                              nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
        self.weight = nn.Parameter(torch.rand(32) + 0.5, requires_grad=False)
        self.to(dtype)
        self.kernels = cpu_kernels.kernels()

    def forward(self, ids, pos):
        x = self.embed(ids) * pos.unsqueeze(-1).to(self.weight.dtype)
        y = self.b(self.kernels.rms_norm(self.a(x)[:, 32:], self.weight, 1e-6))
        return self.c(self.kernels.rms_norm(y, self.weight, 1e-6) + y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_results_only_kernels_read_are_repointed_not_copied(dtype):
    """A replay points the kernels that read a torch op's result at the op's new result; a
    result a torch op or the step's output reads is copied into its captured buffer, as before.
    Either way, replays with new inputs give the eager step's answer, and so does each taped
    call made alone (as bench/roofline.py makes them)."""
    torch.manual_seed(0)
    model, md = _LinearsIntoKernels(dtype), _metadata()
    graph, _, why, _ = StepGraph.capture(model, torch.tensor([3]), torch.tensor([2]), md, 1)
    assert graph is not None, why
    repointed = [args[0] for fn, args in graph._runs if fn is cpu_step_replay._again_repointed]
    copied = [args[0] for fn, args in graph._runs if fn is cpu_step_replay._again_into]
    assert repointed == [torch.ops.aten.linear.default]  # self.a's
    assert copied.count(torch.ops.aten.linear.default) == 2  # self.b's (the torch add reads it), self.c's
    assert [fn for fn, _ in graph._ops if fn is cpu_step_replay._again_repointed] == [cpu_step_replay._again_repointed]
    for tok, p in ((17, 5), (49, 9), (3, 1)):
        ids, pos = torch.tensor([tok]), torch.tensor([p])
        want = model(ids, pos)
        assert torch.equal(graph.replay(ids, pos, md), want)
        assert not torch.equal(graph.replay(torch.tensor([tok + 1]), pos, md), want)
    tapes = [fn for fn, _ in graph._runs if isinstance(fn, cpu_step_replay._Tape)]
    assert len(tapes) == 2
    graph.output.zero_()
    for fn, args in graph._runs:  # the last step (token 4 at position 1) again, one taped call at a time
        if isinstance(fn, cpu_step_replay._Tape):
            assert all(fn.call_one(i) == 0 for i in range(fn._n))
        else:
            fn(*args)
    assert torch.equal(graph.output, model(torch.tensor([4]), torch.tensor([1])))


class _KeepsAResult(_LinearsIntoKernels):
    """Keeps self.a's result, which only the RMSNorm kernel reads in the step, for after it (as a
    model keeping hidden states for a drafter would), or a result that nothing reads."""

    def __init__(self, read: bool) -> None:
        super().__init__(torch.float32)
        self.read = read

    def forward(self, ids, pos):
        x = self.embed(ids) * pos.unsqueeze(-1).to(self.weight.dtype)
        self.kept = self.a(x)[:, 32:]
        return self.b(self.kernels.rms_norm(self.kept if self.read else x[:, :32], self.weight, 1e-6))


class _TwoReaders(_LinearsIntoKernels):
    """self.a's result read by two RMSNorm calls, the second (eps 1e-5) made from Python below."""

    def forward(self, ids, pos):
        h = self.a(self.embed(ids) * pos.unsqueeze(-1).to(self.weight.dtype))[:, :32]
        return self.b(self.kernels.rms_norm(h, self.weight, 1e-6) + self.kernels.rms_norm(h, self.weight, 1e-5))


@pytest.mark.parametrize("read", [True, False], ids=["read-by-a-kernel", "read-by-nothing"])
@torch.inference_mode()
def test_a_result_the_model_keeps_is_rewritten_by_every_replay(read):
    """A result something besides the graph holds is copied, not repointed: what the model kept
    from the captured step shows each replay's value, as it would with the copies."""
    torch.manual_seed(0)
    model, md = _KeepsAResult(read), _metadata()
    graph, _, why, _ = StepGraph.capture(model, torch.tensor([3]), torch.tensor([2]), md, 1)
    assert graph is not None, why
    kept = model.kept
    assert not any(fn is cpu_step_replay._again_repointed and args[0] == torch.ops.aten.linear.default
                   and args[1][1] is model.a.weight for fn, args in graph._runs)
    for tok, p in ((17, 5), (49, 9)):
        ids, pos = torch.tensor([tok]), torch.tensor([p])
        replayed = graph.replay(ids, pos, md).clone()
        was = kept.clone()
        assert torch.equal(replayed, model(ids, pos)) and torch.equal(was, model.kept)


@torch.inference_mode()
def test_a_result_an_untaped_call_reads_is_copied(monkeypatch):
    """A compiled-kernel call made from Python (here: left off the tape) keeps its captured
    pointer, so what it reads is copied into place every replay."""
    real = cpu_step_replay._tape_op
    monkeypatch.setattr(cpu_step_replay, "_tape_op", lambda fn, args: None if 1e-5 in args else real(fn, args))
    torch.manual_seed(0)
    model, md = _TwoReaders(torch.float32), _metadata()
    graph, _, why, _ = StepGraph.capture(model, torch.tensor([3]), torch.tensor([2]), md, 1)
    assert graph is not None, why
    assert any(isinstance(fn, ctypes._CFuncPtr) for fn, _ in graph._runs)
    for tok, p in ((17, 5), (49, 9), (3, 1)):
        ids, pos = torch.tensor([tok]), torch.tensor([p])
        assert torch.equal(graph.replay(ids, pos, md), model(ids, pos))


class _ReadsAValue(nn.Module):
    def forward(self, ids, pos):
        return torch.full((1, 4), float(ids.sum().item()))


class _PythonValueToKernel(nn.Module):
    """A kernel whose argument is a Python value that changes every step (RMSNorm's eps from a
    counter), its output kept in a buffer in place (as K/V are): invisible to the capture."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("kept", torch.zeros(1, 4))
        self.calls = 0
        self.kernels = cpu_kernels.kernels()

    def forward(self, ids, pos):
        self.calls += 1
        x = ids.float().expand(1, 4) + torch.arange(4.0)
        out = self.kernels.rms_norm(x, self.weight, float(self.calls))
        self.kept.copy_(out)
        return out


class _BuildsFromPython(nn.Module):
    def forward(self, ids, pos):
        return ids + torch.tensor([5])  # constant here, but a tensor of Python data in general


class _Random(nn.Module):
    def forward(self, ids, pos):
        return torch.rand(1, 4) + ids


class _TorchOnly(nn.Module):
    def forward(self, ids, pos):
        return (ids * 2).float()


@torch.inference_mode()
def test_a_replay_is_checked_against_the_eager_step():
    """What the capture cannot see (a per-step Python value passed to a kernel) shows in the
    check, and what the eager step wrote is what stays; a faithful graph passes it."""
    md, ids, pos = _metadata(), torch.tensor([3]), torch.tensor([2])
    model = _PythonValueToKernel()
    graph, first, why, _ = StepGraph.capture(model, ids, pos, md, 1)
    assert graph is not None, why
    eager, same = graph.check(model, ids, pos, md)
    assert not same  # the replay used eps = 1 again, the eager step eps = 3
    assert not torch.equal(eager, first)
    assert torch.equal(model.kept, eager)  # the eager step's write, not the replay's
    torch.manual_seed(0)
    model = _KernelAndTorch()
    graph, _, why, _ = StepGraph.capture(model, ids, pos, md, 1)
    eager, same = graph.check(model, torch.tensor([40]), torch.tensor([7]), md)
    assert same
    assert torch.equal(eager, model(torch.tensor([40]), torch.tensor([7])))


@pytest.mark.parametrize(("module", "reason"), [
    (_ReadsAValue, "item"), (_BuildsFromPython, "lift_fresh"), (_Random, "rand"),
    (_TorchOnly, "calls no compiled kernel"),
])
@torch.inference_mode()
def test_capture_is_refused_where_a_replay_would_be_wrong(module, reason):
    """A value read into Python, a tensor built from Python data or random numbers would be
    replayed as captured: the step stays eager, and says why."""
    graph, out, why, too_large = StepGraph.capture(module(), torch.tensor([3]), torch.tensor([2]), _metadata(), 1)
    assert graph is None and not too_large
    assert reason in why
    assert out is not None  # the capture run is the step's eager answer


class _EveryLinearKernel(nn.Module):
    """The quantized linears (4-bit in both code layouts, 8-bit with int8 x where the CPU has it),
    RMSNorm with a residual, SiLU-and-mul and the row argmax, between torch ops: each signature
    the tape encodes, in the dtype given."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        k = self.kernels = cpu_kernels.kernels()
        g = torch.Generator().manual_seed(0)
        n, d = 64, 128
        q4 = torch.randint(0, 16, (n, d), generator=g, dtype=torch.uint8)
        q8 = torch.randint(0, 256, (n, d), generator=g, dtype=torch.uint8)
        scale = torch.rand(n, d // 32, generator=g) * 0.05 + 0.01
        zero = torch.randn(n, d // 32, generator=g) * 0.01
        self.packed = [cpu_kernels.pack_q4(q4, scale, zero, dtype, layout=0)]
        if k.int8_compiled:
            self.packed.append(cpu_kernels.pack_q4(q4, scale, zero, dtype, layout=1))
        self.q8 = (q8, scale, zero)
        self.p8 = cpu_qdot.pack_q8(q8, scale, zero) if k.int8_compiled else None
        self.embed = nn.Embedding(50, d).to(dtype)
        self.weight = nn.Parameter((torch.rand(d) + 0.5).to(dtype), requires_grad=False)

    def forward(self, ids, pos):
        k = self.kernels
        x = self.embed(ids)
        x, residual = k.rms_norm(x, self.weight, 1e-6, residual=x * 0.5)
        h = sum(k.q4_linear(x, p) for p in self.packed)
        h = k.q8_linear(x, *self.q8, 32) + h
        if self.p8 is not None:
            h = k.q8a_linear(x, self.p8) + h
        y = k.silu_and_mul(h * pos.unsqueeze(-1).to(h.dtype))
        value, index = k.row_argmax(y)
        return torch.cat([y.float().flatten(), value.float().flatten(), index.float().flatten(),
                          residual.float().flatten()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.inference_mode()
def test_every_linear_kernel_replays_through_the_tape(dtype):
    k = cpu_kernels.kernels()
    assert k is not None, "the CPU kernels did not build: the tests need a C compiler with OpenMP"
    model = _EveryLinearKernel(dtype)
    md = _metadata()
    graph, _, why, _ = StepGraph.capture(model, torch.tensor([3]), torch.tensor([2]), md, 1)
    assert graph is not None, why
    names = {fn.__name__ for fn, _ in graph._ops if isinstance(fn, ctypes._CFuncPtr)}
    suffix = "f32" if dtype == torch.float32 else "bf16"
    want = {"rms_norm", "q4_linear", "q8_linear", "silu_and_mul", "row_argmax"}
    want |= {"qa_linear"} if k.int8_compiled else set()
    assert names == {f"{n}_{suffix}" for n in want}
    assert not any(isinstance(fn, ctypes._CFuncPtr) for fn, _ in graph._runs)  # every one taped
    for tok, p in ((17, 5), (49, 9), (3, 1)):
        ids, pos = torch.tensor([tok]), torch.tensor([p])
        assert torch.equal(graph.replay(ids, pos, md), model(ids, pos))
