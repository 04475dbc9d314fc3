"""``--kv-cache-dtype int8`` through the real engine: a replayed decode step over the 8-bit cache
answers as its eager step does, prompts prefilled in chunks (each chunk reading the ones before
from the 8-bit cache) get log-probabilities close to the dense cache's, and the same memory holds
more tokens. Platforms whose backend keeps no 8-bit cache refuse the flag at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loom import LLM, SamplingParams
from tiny_models import gpt2_tokenizer

KV_BYTES = 512 << 10
"""Memory for 64 blocks of the dense bf16 cache: below what max_num_seqs x max_model_len asks (129), so
the memory decides how many blocks each dtype gets."""


@pytest.fixture(scope="module")
def llama_head32(tmp_path_factory) -> Path:
    """A 2-layer Llama with head size 32 (4 query heads, 2 KV heads): a shape the int8 kernel takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_head32")
    torch.manual_seed(3)
    tokenizer = gpt2_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)  # spread logits: greedy ties are rare
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), dtype="bfloat16", max_model_len=256, block_size=16, max_num_seqs=8,
               kv_cache_memory_bytes=KV_BYTES, **kwargs)


def _prompts(seed: int, *lengths: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()} for n in lengths]


def test_int8_cache_through_the_engine(llama_head32, expected_platform, monkeypatch):
    if expected_platform != "cpu":
        with pytest.raises(Exception, match="--kv-cache-dtype int8 is not supported"):
            _llm(llama_head32, kv_cache_dtype="int8")
        return
    monkeypatch.delenv("LOOM_CPU_KVCACHE_SPACE", raising=False)
    int8 = _llm(llama_head32, kv_cache_dtype="int8")
    eager = _llm(llama_head32, kv_cache_dtype="int8", enforce_eager=True)
    dense = _llm(llama_head32)
    try:
        # a token per layer: 2 x 2 KV heads x 32 x 2 bytes dense, 2 x 2 x (32 + 4) in int8
        assert dense.llm_engine.executor.num_blocks == KV_BYTES // (16 * 2 * 256)
        assert int8.llm_engine.executor.num_blocks == KV_BYTES // (16 * 2 * 144)

        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = _prompts(1, 9, 33, 17)
        for p in prompts:  # alone, then together: replayed decode steps of 1 and 3 requests
            assert _tokens(int8.generate([p], greedy)) == _tokens(eager.generate([p], greedy))
        assert _tokens(int8.generate(prompts, greedy)) == _tokens(eager.generate(prompts, greedy))
        runner = int8.llm_engine.executor.worker.model_runner
        if runner.attn_layers[0].impl.decodes_in_kernel(torch.bfloat16):
            assert runner._replay and runner._graphs and all(gr.checked for gr in runner._graphs.values())

        # decoding over the int8 cache follows the dense cache: where their greedy tokens part, the
        # int8 pick is one the dense cache scores within a rounding of its own best (this random
        # model's bf16 logits tie often), and up to there their log-probabilities are close
        scored = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
        for got, want in zip(int8.generate(prompts, scored), dense.generate(prompts, scored)):
            g, w = got.outputs[0], want.outputs[0]
            same = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
            assert max(abs(g.logprobs[i][g.token_ids[i]].logprob - w.logprobs[i][w.token_ids[i]].logprob)
                       for i in range(same)) < 0.3
            if same < len(w.token_ids):
                dense_best = w.logprobs[same][w.token_ids[same]].logprob
                assert g.token_ids[same] in w.logprobs[same], "the int8 cache picked a token outside the dense top 3"
                assert dense_best - w.logprobs[same][g.token_ids[same]].logprob < 0.2

        # prompt log-probabilities of a prompt prefilled in chunks of 16 (each after a cached prefix
        # read back from the cache): close to the dense cache's, not equal to them
        chunked = _llm(llama_head32, kv_cache_dtype="int8", max_num_batched_tokens=16, enforce_eager=True)
        dense_chunked = _llm(llama_head32, max_num_batched_tokens=16, enforce_eager=True)
        try:
            scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
            p = _prompts(2, 80)
            got = _prompt_logprobs(chunked.generate(p, scored))
            want = _prompt_logprobs(dense_chunked.generate(p, scored))
            diff = (got - want).abs()
            assert 0 < diff.max() < 0.5 and diff.mean() < 0.05, (diff.max(), diff.mean())
        finally:
            chunked.shutdown()
            dense_chunked.shutdown()
    finally:
        for llm in (int8, eager, dense):
            llm.shutdown()


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _prompt_logprobs(outputs) -> torch.Tensor:
    out = outputs[0]
    ids = out.prompt_token_ids
    return torch.tensor([lp[tok].logprob for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])])


def test_int8_cache_without_its_kernel(llama_head32, expected_platform, caplog):
    """An fp32 model: the int8 kernel takes bf16 only, so decode attention gathers and
    dequantizes in torch, steps run eagerly, and start-up says so; the answers still track the
    dense cache's."""
    if expected_platform != "cpu":  # the dummy platform's backend keeps no int8 cache, in fp32 either
        with pytest.raises(Exception, match="--kv-cache-dtype int8 is not supported"):
            LLM(str(llama_head32), dtype="float32", max_model_len=256, kv_cache_dtype="int8")
        return
    with caplog.at_level("WARNING", logger="loom"):
        int8 = LLM(str(llama_head32), dtype="float32", max_model_len=256, block_size=16, max_num_seqs=8,
                   kv_cache_dtype="int8")
    dense = LLM(str(llama_head32), dtype="float32", max_model_len=256, block_size=16, max_num_seqs=8)
    try:
        assert "no int8 decode kernel here for torch.float32" in caplog.text
        assert not int8.llm_engine.executor.worker.model_runner._replay
        scored = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
        prompts = _prompts(3, 20, 41)
        for got, want in zip(int8.generate(prompts, scored), dense.generate(prompts, scored)):
            g, w = got.outputs[0], want.outputs[0]
            same = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
            assert same >= 1  # the first token comes from the prompt's own, unrounded K/V
            assert max(abs(g.logprobs[i][g.token_ids[i]].logprob - w.logprobs[i][w.token_ids[i]].logprob)
                       for i in range(same)) < 0.3
    finally:
        int8.shutdown()
        dense.shutdown()
