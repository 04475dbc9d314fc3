"""Sampler: logits -> next tokens (and their logprobs), one row per request that samples.

Order of work, as in vLLM: raw logprobs (when asked) -> min_tokens mask -> repetition
penalty -> frequency and presence penalties -> greedy argmax | temperature -> top-k -> top-p -> random draw. Random rows are
drawn together with the exponential race (argmax of p / q, q ~ Exp(1)), which samples from
p; a seeded row draws its q from its own torch.Generator, so its tokens do not depend on
what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from loom_plugin_api import SamplingParams
from loom_plugin_api.step import SampledLogprobs


@dataclass(slots=True, kw_only=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, as tensors (built on CPU, moved by the Sampler)."""

    all_greedy: bool
    temperature: torch.Tensor | None
    """(N,) float; 1.0 on greedy rows. None when every row is greedy."""
    greedy_rows: torch.Tensor | None
    """(N,) bool; None when no row or every row is greedy."""
    top_k: torch.Tensor | None
    """(N,) long, 0 = off; None when no random row uses top-k."""
    top_p: torch.Tensor | None
    """(N,) float; None when no random row uses top-p."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator (seeded random rows)."""
    min_tokens_rows: torch.Tensor | None
    """With ``min_tokens_cols``: (row, token) pairs masked to -inf (EOS and stop ids under min_tokens)."""
    min_tokens_cols: torch.Tensor | None
    penalty_rows: torch.Tensor | None
    """(R,) rows with a repetition penalty and something seen."""
    penalties: torch.Tensor | None
    """(R, 1) their penalties."""
    seen_ids: torch.Tensor | None
    """(R, L) token ids seen by those rows, padded with a repeat of the row's own first id."""
    output_penalty_rows: torch.Tensor | None
    """(S,) rows with a frequency or presence penalty and some output already."""
    frequency_penalties: torch.Tensor | None
    """(S, 1) their frequency penalties."""
    presence_penalties: torch.Tensor | None
    """(S, 1) their presence penalties."""
    output_ids: torch.Tensor | None
    """(S, M) tokens those rows generated so far, padded with -1."""
    num_logprobs: list[int | None]
    max_num_logprobs: int | None
    """Largest ``logprobs`` asked; None when no row asks for logprobs."""

    @property
    def no_processing(self) -> bool:
        return (self.min_tokens_rows is None and self.penalty_rows is None and self.output_penalty_rows is None
                and self.max_num_logprobs is None)

    @classmethod
    def from_requests(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        num_output_tokens: list[int],
        eos_token_id: int | None,
        seen_token_ids: list[list[int]] | None,
        output_token_ids: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """``seen_token_ids``: prompt and output tokens per row (repetition penalty);
        ``output_token_ids``: output tokens per row (frequency and presence penalties).
        Either is None when no row of the step needs it."""
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        temperature = greedy_rows = top_k = top_p = None
        if not all_greedy:
            temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)])
            if any(greedy):
                greedy_rows = torch.tensor(greedy)
            if any(p.top_k > 0 and not g for p, g in zip(params, greedy)):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
            if any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)):
                top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        gens = {i: g for i, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr}

        rows: list[int] = []
        cols: list[int] = []
        for i, p in enumerate(params):
            if num_output_tokens[i] < p.min_tokens:
                stop_ids = list(p.stop_token_ids)
                if eos_token_id is not None and not p.ignore_eos:
                    stop_ids.append(eos_token_id)
                rows.extend([i] * len(stop_ids))
                cols.extend(stop_ids)
        min_rows = torch.tensor(rows, dtype=torch.long) if rows else None
        min_cols = torch.tensor(cols, dtype=torch.long) if rows else None

        penalty_rows = penalties = seen = None
        if seen_token_ids is not None:
            pen = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and seen_token_ids[i]]
            if pen:
                width = max(len(seen_token_ids[i]) for i in pen)
                # Padding with the row's own first id keeps gather/scatter exact (a repeat).
                padded = [s + [s[0]] * (width - len(s)) for s in (seen_token_ids[i] for i in pen)]
                penalty_rows = torch.tensor(pen, dtype=torch.long)
                penalties = torch.tensor([[params[i].repetition_penalty] for i in pen])
                seen = torch.tensor(padded, dtype=torch.long)

        out_rows = freq = pres = out_ids = None
        if output_token_ids is not None:
            pen = [i for i, p in enumerate(params)
                   if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_token_ids[i]]
            if pen:
                width = max(len(output_token_ids[i]) for i in pen)
                padded = [s + [-1] * (width - len(s)) for s in (output_token_ids[i] for i in pen)]
                out_rows = torch.tensor(pen, dtype=torch.long)
                freq = torch.tensor([[params[i].frequency_penalty] for i in pen])
                pres = torch.tensor([[params[i].presence_penalty] for i in pen])
                out_ids = torch.tensor(padded, dtype=torch.long)

        num_logprobs = [p.logprobs for p in params]
        asked = [k for k in num_logprobs if k is not None]
        return cls(
            all_greedy=all_greedy, temperature=temperature, greedy_rows=greedy_rows, top_k=top_k,
            top_p=top_p, generators=gens, min_tokens_rows=min_rows, min_tokens_cols=min_cols,
            penalty_rows=penalty_rows, penalties=penalties, seen_ids=seen, output_penalty_rows=out_rows,
            frequency_penalties=freq, presence_penalties=pres, output_ids=out_ids, num_logprobs=num_logprobs,
            max_num_logprobs=max(asked) if asked else None,
        )


class Sampler(nn.Module):
    """``sampler(logits, metadata) -> (token_ids, logprobs)``.

    ``logits`` (N, V) float32 is modified in place (copying it would cost N x V per step).
    ``logprobs`` is None when no row asked for them, else one entry per row (None for the
    rows that did not ask).
    """

    def forward(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> tuple[list[int], list[SampledLogprobs | None] | None]:
        md = metadata
        if md.all_greedy and md.no_processing:
            return logits.argmax(dim=-1).tolist(), None
        device = logits.device
        # vLLM's default "raw" mode: logprobs of the model's distribution, before any processing.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if md.max_num_logprobs is not None else None
        if md.min_tokens_rows is not None:
            cols = md.min_tokens_cols.to(device)
            keep = cols < logits.shape[1]  # a stop id outside the vocabulary can't be sampled anyway
            logits[md.min_tokens_rows.to(device)[keep], cols[keep]] = float("-inf")
        if md.penalty_rows is not None:
            self._apply_repetition_penalty(logits, md)
        if md.output_penalty_rows is not None:
            self._apply_frequency_presence_penalties(logits, md)

        if md.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            # Greedy rows ignore temperature/top-k/top-p: argmax before those touch the logits.
            greedy = logits.argmax(dim=-1) if md.greedy_rows is not None else None
            tokens = self._sample_random(logits, md)
            if greedy is not None:
                tokens = torch.where(md.greedy_rows.to(device), greedy, tokens)
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return token_list, None
        return token_list, self._gather_logprobs(raw_logprobs, tokens, md)

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, md: SamplingMetadata) -> None:
        # HF semantics: a seen token's positive logit is divided by the penalty, a negative one
        # multiplied, so the penalty always makes it less likely.
        device = logits.device
        rows = md.penalty_rows.to(device)
        seen = md.seen_ids.to(device)
        sub = logits[rows]  # (R, V)
        scores = sub.gather(1, seen)  # (R, L)
        penalties = md.penalties.to(device)
        scores = torch.where(scores > 0, scores / penalties, scores * penalties)
        logits[rows] = sub.scatter(1, seen, scores)

    @staticmethod
    def _apply_frequency_presence_penalties(logits: torch.Tensor, md: SamplingMetadata) -> None:
        # OpenAI semantics over the output so far: logit -= frequency * count + presence * (count > 0).
        device = logits.device
        rows = md.output_penalty_rows.to(device)
        ids = md.output_ids.to(device)  # (S, M), -1 = padding
        real = ids >= 0
        counts = torch.zeros(ids.shape[0], logits.shape[1], dtype=logits.dtype, device=device)
        counts.scatter_add_(1, ids.clamp(min=0), real.to(logits.dtype))  # (S, V)
        penalty = md.frequency_penalties.to(device) * counts + md.presence_penalties.to(device) * (counts > 0)
        logits[rows] -= penalty

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        device = logits.device
        logits = logits.div_(md.temperature.to(device).unsqueeze(1))
        if md.top_k is not None or md.top_p is not None:
            logits = _apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        q = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            q.exponential_()
        for row, generator in md.generators.items():
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(
        raw_logprobs: torch.Tensor, tokens: torch.Tensor, md: SamplingMetadata
    ) -> list[SampledLogprobs | None]:
        sampled = raw_logprobs.gather(1, tokens.unsqueeze(1))  # (N, 1)
        # Rank 1 is the most likely; ties share the better rank, as in vLLM.
        ranks = (raw_logprobs > sampled).sum(dim=-1).add_(1).tolist()
        k = md.max_num_logprobs
        if k:
            top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
            top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
        sampled_l = sampled.squeeze(1).tolist()
        token_l = tokens.tolist()
        out: list[SampledLogprobs | None] = []
        for i, num in enumerate(md.num_logprobs):
            if num is None:
                out.append(None)
                continue
            out.append(SampledLogprobs(
                token_id=token_l[i], logprob=sampled_l[i], rank=ranks[i],
                top_token_ids=top_ids_l[i][:num] if num else [],
                top_logprobs=top_vals_l[i][:num] if num else [],
            ))
        return out


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask to -inf what falls outside top-k, then outside the top-p nucleus (always keeps one)."""
    vocab = logits.shape[1]
    device = logits.device
    if top_p is None:
        # top-k alone: a partial topk is much cheaper than a full sort. top_k is built on the
        # host: deciding there costs no device sync.
        on_host = (top_k > 0) & (top_k < vocab)
        if not bool(on_host.any()):
            return logits
        max_k = int(top_k[on_host].max())
        k, on = top_k.to(device), on_host.to(device)
        top_vals = logits.topk(max_k, dim=-1).values
        kth = top_vals.gather(1, (k.clamp(1, max_k) - 1).unsqueeze(1))
        kth = torch.where(on.unsqueeze(1), kth, float("-inf"))
        return logits.masked_fill_(logits < kth, float("-inf"))
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = top_k.to(device)
        k = torch.where((k <= 0) | (k > vocab), vocab, k)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum = probs.cumsum(dim=-1)
    # Drop the low tail whose mass is at most 1 - p; the last (largest) token always stays.
    drop = cum <= 1 - top_p.to(device).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)
