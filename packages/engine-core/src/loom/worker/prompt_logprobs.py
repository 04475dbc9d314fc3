"""Prompt logprobs: how likely the model finds each prompt token, collected across prefill chunks.

A prefill step computes hidden states for every prompt position in its chunk, but only the
last one normally reaches the LM head. For a request that asks for prompt logprobs, the
logits of position ``p`` score prompt token ``p + 1``; the last prompt position scores the
first output token and is left to the sampler. A chunk ``[s, e)`` therefore scores tokens
``s + 1 .. e`` (the last of them is the first token of the next chunk, known from the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from loom_plugin_api.step import PromptLogprobs, ScheduledRequest

_ROWS_PER_PASS = 256
"""Prompt positions sent through the LM head at once: bounds the (rows, vocab) logits held."""


@dataclass(slots=True)
class PromptLogprobsState:
    prompt_token_ids: list[int]
    num_top: int
    """Top alternatives to return per token (0: only the prompt token's own logprob)."""
    next_pos: int = 0
    """The next prompt position to score with; positions before it were scored (kept across preemptions)."""


def collect_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_states: torch.Tensor,
    scheduled: list[ScheduledRequest],
    states: dict[str, PromptLogprobsState],
) -> list[PromptLogprobs]:
    """Score the prompt tokens this step's chunks reach, for the requests in ``states``.

    ``hidden_states`` (T, hidden) is the step's flat output, requests in ``scheduled`` order.
    A request leaves ``states`` once its whole prompt is scored. Every tensor-parallel rank
    must call this with the same arguments (the LM head gathers across ranks); each updates
    its own ``states`` the same way.
    """
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[str, int, int, int]] = []  # (req_id, first token scored, count, num_top)
    offset = 0
    for req in scheduled:
        num_new = len(req.token_ids)
        state = states.get(req.req_id)
        if state is not None:
            start = req.num_computed_tokens
            if state.next_pos < start:
                raise RuntimeError(
                    f"request {req.req_id!r} skipped prompt positions {state.next_pos}..{start - 1}; prompt "
                    "logprobs need every prompt position computed (no prefix-cache hits)"
                )
            lo = state.next_pos
            last = len(state.prompt_token_ids) - 1  # scores the first output token: the sampler's
            hi = min(start + num_new, last)
            if lo < hi:
                rows.extend(range(offset + lo - start, offset + hi - start))
                targets.extend(state.prompt_token_ids[lo + 1 : hi + 1])
                spans.append((req.req_id, lo + 1, hi - lo, state.num_top))
                state.next_pos = hi
            if state.next_pos >= last:
                del states[req.req_id]
        offset += num_new
    if not rows:
        return []

    device = hidden_states.device
    row_idx = torch.tensor(rows, dtype=torch.long, device=device)
    target_idx = torch.tensor(targets, dtype=torch.long, device=device)
    max_top = max(s[3] for s in spans)
    chosen_parts, rank_parts, top_val_parts, top_id_parts = [], [], [], []
    for a in range(0, len(rows), _ROWS_PER_PASS):
        b = a + _ROWS_PER_PASS
        logprobs = torch.log_softmax(compute_logits(hidden_states[row_idx[a:b]]).float(), dim=-1)  # (n, V)
        chosen = logprobs.gather(1, target_idx[a:b].unsqueeze(1))  # (n, 1)
        chosen_parts.append(chosen.squeeze(1))
        # Rank 1 is the most likely; ties share the better rank, as for sampled tokens.
        rank_parts.append((logprobs > chosen).sum(dim=-1).add_(1))
        if max_top:
            top_vals, top_ids = logprobs.topk(max_top, dim=-1)
            top_val_parts.append(top_vals)
            top_id_parts.append(top_ids)
    chosen_l = torch.cat(chosen_parts).tolist()
    ranks_l = torch.cat(rank_parts).tolist()
    top_vals_l = torch.cat(top_val_parts).tolist() if max_top else None
    top_ids_l = torch.cat(top_id_parts).tolist() if max_top else None

    out = []
    pos = 0
    for req_id, first, count, num_top in spans:
        end = pos + count
        top_ids = [ids[:num_top] for ids in top_ids_l[pos:end]] if num_top else [[] for _ in range(count)]
        top_values = [v[:num_top] for v in top_vals_l[pos:end]] if num_top else [[] for _ in range(count)]
        out.append(
            PromptLogprobs(
                req_id=req_id,
                start=first,
                logprobs=chosen_l[pos:end],
                ranks=ranks_l[pos:end],
                top_token_ids=top_ids,
                top_logprobs=top_values,
            )
        )
        pos = end
    return out
