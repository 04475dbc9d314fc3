"""Quantized linear layers: GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks kept as they are (``--quantization gguf``)
and round-to-nearest int4/int8 of a safetensors model (``--quantization int4`` / ``int8``).

Each check compares the quantized path with the same quantized weights dequantized and run
through the dense path: the block decoding exactly, one matmul per width and dtype, a tiny llama
written as GGUF with all three formats (logits), a tiny safetensors llama quantized at load, and
the embedded SmolLM2 file (greedy tokens and the chat answer).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loom import envs
from loom.layers import onednn, quantized
from loom.layers.quantized import CpuQuantizedWeight, cpu_quantized_linear, quantize_rtn
from loom.model_loader import get_model
from loom.model_loader.gguf_quant import (
    FORMATS,
    dequantize_int4,
    dequantize_q8_0,
    split_blocks,
    split_int4_blocks,
)
from loom.platforms import cpu_qdot
from loom.platforms.cpu_kernels import kernels, unpack_q4
from loom.transformers_utils.tokenizer import get_tokenizer
from loom_plugin_api.custom_op import kernel_registry
from loom_plugin_api.ops import QuantizedLinear, QuantizedWeight
from model_utils import (
    ModelRunnerHarness,
    greedy_generate,
    install_quantized_kernel,
    make_config,
    run_prefill,
    tp_prefill_worker,
)
from test_gguf import QUESTION, SMOLLM2, _write_tiny_gguf, cache_root, random_k_blocks  # noqa: F401 (its module-wide LOOM_CACHE_DIR)

gguf = pytest.importorskip("gguf")
Q4 = [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1]
Q8_0 = gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(autouse=True)
def _live_envs():
    """Read LOOM_* as the test sets them (LOOM_CPU_INT8_ACTIVATIONS at packing)."""
    envs._disable_envs_cache_for_tests()


@pytest.fixture(autouse=True)
def cpu_kernel():
    """The CPU platform's quantized_linear kernel, as a worker has it; the registry restored afterwards."""
    saved = dict(kernel_registry)
    install_quantized_kernel()
    yield
    kernel_registry.clear()
    kernel_registry.update(saved)


def _quantized(rows: int, cols: int, qtype, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    w[0, :32] += 3.0  # a block whose minimum is far from zero (Q4_1's m)
    return gguf.quants.quantize(w, qtype)


def _weight(qtype, rows: int = 96, cols: int = 128) -> QuantizedWeight:
    q, scale, zero = split_blocks(_quantized(rows, cols, qtype), qtype.name)
    return QuantizedWeight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero),
                           4 if qtype in Q4 else 8, 32)


@pytest.mark.parametrize("qtype", [*Q4, Q8_0], ids=lambda t: t.name)
def test_blocks_decode_exactly_as_gguf_dequantizes(qtype):
    raw = _quantized(48, 96, qtype)
    q, scale, zero = split_blocks(raw, qtype.name)
    assert q.shape == (48, 96) and scale.shape == zero.shape == (48, 3) and q.dtype == np.uint8
    w = QuantizedWeight(torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(zero),
                        4 if qtype in Q4 else 8, 32)
    np.testing.assert_array_equal(w.dequantize().numpy(), gguf.quants.dequantize(raw, qtype))
    if qtype in Q4:
        assert q.max() <= 15
        np.testing.assert_array_equal(dequantize_int4(q, scale, zero), gguf.quants.dequantize(raw, qtype))
    else:
        np.testing.assert_array_equal(dequantize_q8_0(raw), gguf.quants.dequantize(raw, qtype))
        with pytest.raises(ValueError, match="Q8_0 is not a 4-bit block format"):
            split_int4_blocks(raw, "Q8_0")


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_decode_as_gguf_dequantizes(type_name):
    """Q4_K and Q6_K super-blocks as codes, scales and zeros: the weights gguf's own dequantizer
    gives (to one fp32 rounding of Q4_K's zero term; in practice every bit)."""
    raw = random_k_blocks(6, 768, type_name, seed=1)
    q, scale, zero = (torch.from_numpy(a) for a in split_blocks(raw, type_name))
    bits, group = FORMATS[type_name]
    assert q.shape == (6, 768) and scale.shape == zero.shape == (6, 768 // group) and q.dtype == torch.uint8
    assert int(q.max()) < 2 ** bits and (type_name == "Q4_K" or int(q.min()) >= 96)
    got = QuantizedWeight(q, scale, zero, bits, group).dequantize().numpy()
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)).reshape(6, 768)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    with pytest.raises(ValueError, match="not whole super-blocks"):
        split_blocks(raw[:, :-1], type_name)


@pytest.fixture(scope="module")
def tiny_k_gguf(tmp_path_factory):
    """A Llama of K-quant widths (hidden 256, MLP 512) stored as a Q4_K_M file is: Q4_K q/k/o and
    gate/up, Q6_K v, down and the LM head (random blocks: the file's values are the model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=3 + 259, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=1000.0, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("tiny_k") / "tiny-k.gguf")
    q4_k, q6_k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K

    def quant(name: str):
        if name == "output.weight" or name.endswith(("attn_v.weight", "ffn_down.weight")):
            return q6_k
        return q4_k if name.startswith("blk.") else None

    _write_tiny_gguf(path, LlamaForCausalLM(config).float().eval(), quant=quant)
    return path


@pytest.mark.parametrize("int8_x", ["0", "1"])
def test_k_quant_layers_stay_quantized_and_match_dequantized(tiny_k_gguf, monkeypatch, int8_x):
    """Q4_K layers run as 4-bit groups of 32, Q6_K ones as 8-bit groups of 16 (the exact 8-bit
    kernel); q/k/v mix the two and stay dense. Decode-sized steps give the dequantized model's
    logits (x exact: tightly; int8 x on the Q4_K layers: moved, and within a bound that only
    catches a broken kernel; test_cpu_qdot.py checks the rounding itself)."""
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", int8_x)
    dense = get_model(make_config(tiny_k_gguf, quantization="none"))
    packed = get_model(make_config(tiny_k_gguf, quantization="gguf"))
    layers = _quantized_layers(packed)
    assert layers == {"model.layers.0.self_attn.o_proj": 4, "model.layers.0.mlp.gate_up_proj": 4,
                      "model.layers.0.mlp.down_proj": 8}, layers
    head = packed.logits_processor.quantized_head
    assert head is not None and head.kernel_weight().bits == 8 and head.kernel_weight().group_size == 16
    _assert_same_state(packed, dense)
    with torch.inference_mode():
        for prompt in ([5], [17], [200, 3, 42]):
            got, want = run_prefill(packed, [prompt])[0], run_prefill(dense, [prompt])[0]
            err = float((got - want).abs().max() / want.abs().max())
            if int8_x == "0" or not kernels().int8_compiled:
                assert err < 1e-4, err
            else:  # the Q4_K layers rounded x: 16% of the logits' range measured on these random blocks
                assert 0 < err < 0.3, err


@pytest.mark.parametrize("qtype", [*Q4, Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 7, 64])
def test_cpu_kernel_matches_the_dequantized_weight(qtype, dtype, rows):
    """Few rows through the codes (the C 4- or 8-bit kernel), many through the dense copy. Where the
    CPU has AVX512-VNNI the few rows quantize x to int8 per group (cpu_qdot.c): those match the
    emulation of that tightly and the exact product within the error of x's rounding."""
    weight = _weight(qtype)
    prepared = cpu_quantized_linear.prepare(weight, dtype)  # the CPU platform's kernel, whichever platform runs
    assert isinstance(prepared, CpuQuantizedWeight)
    int8_x = kernels().int8_activations
    assert (prepared.q4 is not None) == (qtype in Q4)
    assert (prepared.q8 is not None) == (qtype == Q8_0 and int8_x) and (prepared.codes is not None) == (qtype == Q8_0 and not int8_x)
    # the int8-activation kernels take up to 8 rows, the others 4 (a row costs them a dequantized weight)
    assert prepared.max_rows == (quantized.QUANT_INT8_MAX_ROWS if int8_x else quantized.QUANT_MAX_ROWS)
    if int8_x and rows <= prepared.max_rows:
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert torch.equal(cpu_quantized_linear(x, prepared), prepared.few_rows(x))  # the op takes them so
        if qtype in Q4:
            assert prepared.q4.layout == 1
            q, scale, zero = unpack_q4(prepared.q4)
            assert torch.equal(q, weight.qweight)
            emulated = cpu_qdot.emulate(x, q, scale, zero - 8 * scale)
        else:
            emulated = cpu_qdot.emulate(x, weight.qweight, weight.scale, weight.zero - 128 * weight.scale)
        got = prepared.few_rows(x).float()
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # fp32: sums' order; bf16: the output's rounding
        torch.testing.assert_close(got, emulated.float(), rtol=tol, atol=tol * float(emulated.abs().max()))
        # x's rounding: at most half a step (max|x| / 254 in its group) per element, times the weight
        w = weight.dequantize()
        xg = x.float().view(rows, 4, 32)
        step = (xg.abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32).reshape(rows, 128)
        bound = step @ w.abs().t() * 1.01 + (0 if dtype == torch.float32 else got.abs() / 128)
        assert ((got - x.float() @ w.t()).abs() <= bound).all()
        return
    exact = weight.dequantize()
    dense = onednn.dense(prepared.dense)  # (oneDNN-packed or in panels where enabled)
    assert torch.equal(dense, exact.to(dtype))  # the copy for large batches: the file's weights
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    bias = torch.randn(96).to(dtype)
    if rows <= prepared.max_rows:
        assert prepared.few_rows(x) is not None  # a kernel that reads the codes took them
    got = cpu_quantized_linear(x, prepared, bias)
    assert got.shape == (rows, 96) and got.dtype == dtype
    want = x.float() @ exact.t() + bias.float()
    atol = 8e-3 * float(want.abs().max())  # bf16 rounds the inputs and the output: relative to the output's scale
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    elif prepared.q4 is not None and rows <= prepared.max_rows:
        # the 4-bit kernel holds scales and zeros in bf16 (within bf16 rounding of the file's)
        q, scale, zero = unpack_q4(prepared.q4)
        assert torch.equal(q, weight.qweight)
        held = QuantizedWeight(q, scale, zero, 4, 32).dequantize()
        torch.testing.assert_close(held, exact, atol=2e-2, rtol=8e-3)
        torch.testing.assert_close(got.float(), x.float() @ held.t() + bias.float(), atol=atol, rtol=8e-3)
    else:  # exact weights in fp32 (8-bit kernel) or rounded once to bf16 (dense copy), output rounded to bf16
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=8e-3)
        native = QuantizedLinear.forward_native(QuantizedLinear(weight, dtype), x, bias)
        torch.testing.assert_close(got.float(), native.float(), atol=atol, rtol=8e-3)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_round_to_nearest_is_within_half_a_step(bits, group_size):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    w[3, :group_size] = 0.25  # a constant group
    q, scale, zero = quantize_rtn(w, bits, group_size)
    assert q.dtype == torch.uint8 and scale.shape == zero.shape == (64, 256 // group_size)
    assert int(q.max()) <= 2**bits - 1 and (bits == 4 or int(q.min()) >= 1)
    deq = QuantizedWeight(q, scale, zero, bits, group_size).dequantize()
    step = scale.repeat_interleave(group_size, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    torch.testing.assert_close(deq[3, :group_size], w[3, :group_size], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rtn(w[:, :100], bits, group_size)


@pytest.fixture(scope="module")
def tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=3 + 259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, rope_theta=1000.0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_hf, tmp_path_factory):
    """The tiny llama with attention in Q4_0, gate/up in Q4_1, down and the LM head in Q8_0
    (the embedding F32)."""
    path = str(tmp_path_factory.mktemp("tiny_q") / "tiny-q.gguf")

    def quant(name: str):
        if name == "output.weight":
            return Q8_0
        if not name.startswith("blk."):
            return None
        return Q4[0] if ".attn_" in name else Q8_0 if "ffn_down" in name else Q4[1]

    _write_tiny_gguf(path, tiny_hf, quant=quant)
    return path


def _assert_same_state(packed, dense) -> None:
    """Quantized layers show their dense weights; no code/scale parameter is left behind."""
    assert not any(name.endswith(("qweight", "qscale", "qzero")) for name, _ in packed.named_parameters())
    dense_state, packed_state = dense.state_dict(), packed.state_dict()
    assert set(packed_state) == set(dense_state)
    for name, tensor in dense_state.items():
        torch.testing.assert_close(packed_state[name].float(), tensor.float(), atol=0, rtol=0, msg=name)


def _quantized_layers(model) -> dict[str, int]:
    """``{layer: bits}``; on the CPU platform a layer's op has released its weight to the kernel's layout."""
    return {name: (m.weight.weight or m.weight.kernel_weight()).bits for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), QuantizedLinear)}


@pytest.mark.parametrize("max_rows", [10**6, 0], ids=["codes", "dense copy"])
def test_tiny_gguf_logits_match_dequantized(tiny_gguf, monkeypatch, max_rows):
    """Through the codes' kernels (every batch size), then through the layers' dense copies; x in
    the weights' dtype (int8 activations: test_int8_activations_stay_close_to_the_dense_model)."""
    monkeypatch.setattr(quantized, "QUANT_MAX_ROWS", max_rows)
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", "0")
    dense = get_model(make_config(tiny_gguf, quantization="none"))
    packed = get_model(make_config(tiny_gguf, quantization="gguf"))
    layers = _quantized_layers(packed)
    assert sorted(layers.values()) == [4] * 6 + [8] * 2  # qkv, o, gate_up (4-bit) and down (8-bit) per layer
    for name in layers:  # with the CPU kernel the op keeps only the kernel's layouts (one copy of the codes)
        op = packed.get_submodule(name).weight
        assert (op.weight is None) == isinstance(op.kernel_weight(), CpuQuantizedWeight), name
    head = packed.logits_processor.quantized_head
    assert head is not None and head.kernel_weight().bits == 8
    assert head.kernel_weight().shape == tuple(packed.lm_head.weight.shape)
    _assert_same_state(packed, dense)
    prompts = [[5, 17, 200, 3, 42, 261, 0], list(range(100, 140))]
    with torch.inference_mode():
        for got, want in zip(run_prefill(packed, prompts), run_prefill(dense, prompts)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert greedy_generate(packed, prompts[0], 8) == greedy_generate(dense, prompts[0], 8)


def test_int8_activations_stay_close_to_the_dense_model(tiny_gguf, monkeypatch):
    """Decode steps (one row) through the int8-activation kernels: the logits within the rounding
    of x to 8 bits per group of the dense model's (4-7% of their range on this random model), the
    layers really on those kernels, and the same tokens as with x kept in fp32 over 8 steps (with
    the 7-token prefill on the dense copies). A prefill of 7 rows, within the kernels' 8, also runs
    on them: its logits within the same rounding."""
    if not kernels().int8_compiled:  # pragma: no cover - the CI machine has AVX512-VNNI
        assert kernels().pack_q8(torch.zeros(1, 32, dtype=torch.uint8), torch.ones(1, 1), torch.zeros(1, 1), 32) is None
        return
    dense = get_model(make_config(tiny_gguf, quantization="none"))
    prompt = [5, 17, 200, 3, 42, 261, 0]
    eight_rows = get_model(make_config(tiny_gguf, quantization="gguf"))  # QUANT_INT8_MAX_ROWS as shipped
    monkeypatch.setattr(quantized, "QUANT_INT8_MAX_ROWS", quantized.QUANT_MAX_ROWS)  # 7 rows: the dense copies
    packed = get_model(make_config(tiny_gguf, quantization="gguf"))
    prepared = [m.weight.kernel_weight() for m in packed.modules() if isinstance(getattr(m, "weight", None), QuantizedLinear)]
    # the CPU platform's layers hold its kernels' layouts; another platform (the dummy one) runs the
    # contract's path on the neutral weights, where nothing rounds x
    on_cpu_kernels = all(isinstance(p, CpuQuantizedWeight) for p in prepared)
    if on_cpu_kernels:
        assert all(p.q4 is None or p.q4.layout == 1 for p in prepared)
        assert packed.logits_processor.quantized_head.kernel_weight().q8 is not None
    with torch.inference_mode():
        got, want, exact = run_prefill(eight_rows, [prompt])[0], run_prefill(dense, [prompt])[0], run_prefill(packed, [prompt])[0]
        err = (got - want).abs().max() / want.abs().max()
        if on_cpu_kernels:
            assert 0 < err < 0.1, err  # nonzero: 7 rows went through the int8 kernels
            torch.testing.assert_close(exact, want, atol=2e-4, rtol=1e-4)  # and not with the limit at 4
        else:
            assert err < 1e-4, err
        for rows in ([p] for p in prompt):  # one-token prompts: every linear on the few-rows kernels
            got, want = run_prefill(packed, [rows])[0], run_prefill(dense, [rows])[0]
            err = (got - want).abs().max() / want.abs().max()
            if on_cpu_kernels:
                assert 0 < err < 0.1, err  # nonzero: the int8 kernels ran; 4-7% measured here
            else:
                assert err < 1e-4, err
        assert greedy_generate(packed, prompt, 8) == greedy_generate(dense, prompt, 8)


@pytest.mark.timeout(300)
def test_tensor_parallel_2_matches_one_rank(tiny_gguf, tmp_path, monkeypatch):
    """Two gloo ranks slice the quantized parameters as they slice dense weights: the same logits.
    Per rank, o_proj's input is 32 wide (quantized) and down_proj's 48 (not whole groups: dense).
    Four rows in the step, so the kernels that read the codes (not the dense copies) compute them."""
    prompts = [[5, 17], [200, 3]]
    monkeypatch.setenv("LOOM_CPU_INT8_ACTIVATIONS", "0")  # x exact on both sides: the slicing alone shows
    out = tmp_path / "tp_logits.pt"
    torch.multiprocessing.spawn(tp_prefill_worker, args=(2, str(tmp_path / "init"), [tiny_gguf], prompts, str(out),
                                                         {"quantization": "gguf"}), nprocs=2, join=True)
    one = get_model(make_config(tiny_gguf, quantization="gguf"))
    results = torch.load(out)
    assert results[tiny_gguf + ":quantized layers"] == 2 * 3  # qkv, o and gate_up per layer
    for got, want in zip(results[tiny_gguf], run_prefill(one, prompts)):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_safetensors(tiny_hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_st")
    tiny_hf.save_pretrained(path)
    return str(path)


_FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def _rtn_values(hf_state: dict, name: str, bits: int, group_size: int) -> torch.Tensor:
    """What round to nearest makes of a loom layer's HF weights (a fused layer: its parts' rows in order)."""
    prefix, _, module = name.partition(".self_attn.") if ".self_attn." in name else name.partition(".mlp.")
    kind = "self_attn." if ".self_attn." in name else "mlp."
    parts = _FUSED.get(kind + module, (module,))
    rows = []
    for part in parts:
        w = hf_state[f"{prefix}.{kind}{part}.weight"]
        rows.append(QuantizedWeight(*quantize_rtn(w, bits, group_size), bits, group_size).dequantize())
    return torch.cat(rows)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_round_to_nearest_at_load_matches_its_dequantized_weights(tiny_hf, tiny_safetensors, bits, group_size,
                                                                  monkeypatch):
    """``--quantization int4/int8``: every linear layer whose input is whole groups holds the round
    to nearest of the checkpoint's weights, and the model computes with exactly those values:
    prefill (the dense copies) and greedy decoding of one row (the code kernels) equal the dense
    model given them."""
    monkeypatch.setattr(quantized, "QUANT_INT8_MAX_ROWS", quantized.QUANT_MAX_ROWS)  # the 5-row prefill: dense copies
    config = make_config(tiny_safetensors, quantization=f"int{bits}", quantization_group_size=group_size)
    packed = get_model(config)
    dense = get_model(make_config(tiny_safetensors))
    layers = _quantized_layers(packed)
    expected = 8 if group_size == 32 else 6  # down_proj's input (96) is not whole groups of 64
    assert len(layers) == expected and set(layers.values()) == {bits}
    state, hf_state = packed.state_dict(), tiny_hf.state_dict()
    for name in layers:  # the dense model given the round-to-nearest values (a plain weight: F.linear)
        want = _rtn_values(hf_state, name, bits, group_size)
        torch.testing.assert_close(state[name + ".weight"], want, atol=0, rtol=0, msg=name)
        dense.get_submodule(name).weight = torch.nn.Parameter(want, requires_grad=False)
    prompts = [[5, 17, 200], [42, 7]]
    with torch.inference_mode():
        for got, want in zip(run_prefill(packed, prompts), run_prefill(dense, prompts)):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        assert greedy_generate(packed, prompts[0], 8) == greedy_generate(dense, prompts[0], 8)


def test_quantization_choices_are_checked(tiny_gguf, tiny_safetensors):
    with pytest.raises(ValueError, match="--quantization gguf keeps a GGUF file's blocks"):
        make_config(tiny_safetensors, quantization="gguf")
    with pytest.raises(ValueError, match="--quantization int4 quantizes a safetensors checkpoint"):
        make_config(tiny_gguf, quantization="int4")
    with pytest.raises(ValueError, match="--quantization-group-size must be one of"):
        make_config(tiny_safetensors, quantization="int8", quantization_group_size=48)
    assert make_config(tiny_safetensors, dtype="bfloat16").model_config.quantization == "none"


def test_auto_keeps_blocks_only_in_bfloat16(tiny_gguf):
    assert make_config(tiny_gguf, dtype="float32").model_config.quantization == "none"
    assert make_config(tiny_gguf, dtype="bfloat16").model_config.quantization == "gguf"
    assert make_config(tiny_gguf, dtype="bfloat16", quantization="none").model_config.quantization == "none"


def _forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits each of ``tokens`` was chosen from, with ``tokens`` fed back (teacher forcing):
    ``(len(tokens), vocab)``, the first from the prompt's prefill, the rest from decode steps."""
    h = ModelRunnerHarness(model, block_size=16, max_blocks_per_req=(len(prompt) + len(tokens)) // 16 + 1, max_reqs=1)
    rows = [h.step({0: prompt})[-1]]
    rows += [h.step({0: [t]})[-1] for t in tokens[:-1]]
    return torch.stack(rows).float()


def test_default_model_quantized_greedy_matches_dequantized():
    """SmolLM2's Q4_1 linears kept quantized against the same file dequantized, in fp32, over 32
    greedy tokens of the chat question. Where the CPU has AVX512-VNNI the decode steps' matmuls
    round x to 8 bits per group of 32, which moves the logits by up to about 6% of their range
    (mostly far from the top): given the dequantized model's tokens, the quantized model picks the
    same token at every step except where the dequantized model's two best are within 3% of the
    range of each other (a near-tie, about half of these steps;
    ``python bench/quant_agreement.py`` counts how often free-running answers differ). Without
    int8 activations every step agrees; either way the answer names Paris."""
    config = make_config(SMOLLM2, quantization="gguf")
    dense, packed = get_model(make_config(SMOLLM2, quantization="none")), get_model(config)
    assert len(_quantized_layers(packed)) == 30 * 4
    tok = get_tokenizer(config.model_config)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    prompt = tok(text)["input_ids"]
    with torch.inference_mode():
        want = greedy_generate(dense, prompt, 32)
        d, q = _forced_logits(dense, prompt, want), _forced_logits(packed, prompt, want)
        got = greedy_generate(packed, prompt, 32)
    assert d.argmax(-1).tolist() == want
    span = d.amax(-1) - d.amin(-1)
    # each step's pick: the dequantized model's best, or a runner-up within 3% of the range of it
    behind = (d.amax(-1) - d.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)) / span
    assert (behind < 0.03).all(), f"steps {(behind >= 0.03).nonzero().flatten().tolist()} differ beyond a near-tie"
    moved = float(((q - d).abs().amax(-1) / span).max())
    k = kernels()
    if k is not None and k.int8_activations:
        assert 0 < moved < 0.1, moved  # nonzero: x was rounded; 5.8% at the worst step measured
    else:
        assert moved < 1e-3 and got == want, moved
    assert "Paris" in tok.decode(got)


def test_without_a_kernel_the_layers_stay_dense(tiny_gguf):
    """``--custom-ops -quantized_linear`` (as an out-of-tree platform without a kernel): the op would
    run ``forward_native``, which dequantizes every weight on every call, so the loader keeps the
    same values dense and installs no quantized LM head."""
    packed = get_model(make_config(tiny_gguf, quantization="gguf", custom_ops=["-quantized_linear"]))
    dense = get_model(make_config(tiny_gguf, quantization="none"))
    assert _quantized_layers(packed) == {} and packed.logits_processor.quantized_head is None
    _assert_same_state(packed, dense)
    with torch.inference_mode():
        for got, want in zip(run_prefill(packed, [[5, 17, 200]]), run_prefill(dense, [[5, 17, 200]])):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_quantized_head_takes_as_many_rows_as_its_kernel(tiny_gguf):
    """The LM head's codes serve steps of up to the kernel's ``max_rows`` (8 with int8 activations,
    else ``QUANT_MAX_ROWS``); larger steps take the dense head."""
    packed = get_model(make_config(tiny_gguf, quantization="gguf"))
    head = packed.logits_processor.quantized_head
    limit = getattr(head.kernel_weight(), "max_rows", quantized.QUANT_MAX_ROWS)
    if isinstance(head.kernel_weight(), CpuQuantizedWeight):
        assert limit == (quantized.QUANT_INT8_MAX_ROWS if kernels().int8_activations else quantized.QUANT_MAX_ROWS)
    hidden = packed.lm_head.weight.shape[1]
    with torch.inference_mode():
        for rows in (1, limit, limit + 1):
            h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(rows))
            got = packed.logits_processor._quantized_logits(packed.lm_head, h)
            assert (got is None) == (rows > limit), rows
            if got is not None:
                assert got.shape[0] == rows
