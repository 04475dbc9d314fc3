"""Greedy generations of loom match HF transformers token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from loom import LLM, SamplingParams

MAX_TOKENS = 12


def hf_greedy(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def prompts_of(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_llama_tied", "tiny_opt"])
def test_greedy_matches_hf(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    # 70 tokens exceed the 32-token step budget: that prompt is prefilled in chunks,
    # mixed with the decodes of the shorter prompts.
    prompts = prompts_of([5, 17, 70, 1, 33], vocab=50000)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=32, max_model_len=256, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == hf_greedy(model_dir, prompts)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_text_prompts_and_prefix_cache_agree(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256)
    tokenizer = llm.get_tokenizer()
    shared = "The quick brown fox jumps over the lazy dog. " * 4
    prompts = [shared + "Once", shared + "Twice", shared + "Once"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)  # prefix-cached now
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert first[0].outputs[0].token_ids == first[2].outputs[0].token_ids
    assert first[0].prompt == prompts[0] and first[0].prompt_token_ids == tokenizer.encode(prompts[0])
    ids = hf_greedy(tiny_llama, [tokenizer.encode(p) for p in prompts[:2]])
    assert [list(o.outputs[0].token_ids) for o in first[:2]] == [i[:8] for i in ids]


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """(len(prompt) - 1, vocab): row j is the log-distribution that scores prompt[j + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_opt"])
def test_prompt_logprobs_match_hf(request, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    # 70 and 45 tokens exceed the 32-token step budget: their prompt logprobs are collected
    # over several prefill chunks, next to a request that asks for none.
    prompts = prompts_of([70, 5, 1, 45], vocab=50000, seed=1)
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=32, max_model_len=256, block_size=16)
    with_lp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    without = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    params = [with_lp, with_lp, with_lp, without]
    for attempt in range(2):  # the second time the prompts are in the prefix cache
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert outputs[3].prompt_logprobs is None
        for prompt, out in zip(prompts[:3], outputs[:3]):
            got = out.prompt_logprobs
            assert len(got) == len(prompt) and got[0] is None, attempt
            if len(prompt) == 1:
                continue
            ref = hf_prompt_logprobs(model_dir, prompt)
            for j in range(1, len(prompt)):
                entry, row = got[j], ref[j - 1]
                token = prompt[j]
                assert abs(entry[token].logprob - float(row[token])) < 1e-4, (attempt, j)
                # rank = 1 + tokens above it; a token within float noise of it may fall either side
                above = [int((row > row[token] + d).sum()) + 1 for d in (1e-5, -1e-5)]
                assert above[0] <= entry[token].rank <= above[1], (attempt, j, entry[token].rank, above)
                top3 = sorted((lp.rank, tid) for tid, lp in entry.items() if lp.rank <= 3)
                assert [tid for _, tid in top3] == row.topk(3).indices.tolist(), (attempt, j)
                assert len(entry) == (3 if entry[token].rank <= 3 else 4)
    # prompt logprobs do not change what is generated
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], without)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs[:2]]
