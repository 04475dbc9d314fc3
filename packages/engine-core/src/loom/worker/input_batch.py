"""Turn a SchedulerOutput into the flat tensors one model step needs."""

from __future__ import annotations

import numpy as np
import torch
from loom_plugin_api import AttentionMetadata
from loom_plugin_api.step import ModelInput, SchedulerOutput

__all__ = ["ModelInput", "prepare_inputs"]


def prepare_inputs(scheduler_output: SchedulerOutput, block_size: int, device: torch.device) -> ModelInput:
    reqs = scheduler_output.scheduled
    num_reqs = len(reqs)
    q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=num_reqs)
    starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=num_reqs)
    cu = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    total = int(cu[-1])
    token_ids = np.fromiter(
        (t for r in reqs for t in r.token_ids), dtype=np.int64, count=total,
    )
    # position of token j of request i = starts[i] + j
    positions = np.repeat(starts - cu[:-1], q_lens) + np.arange(total, dtype=np.int64)
    max_blocks = max(len(r.block_ids) for r in reqs)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int64)
    for i, r in enumerate(reqs):
        block_tables[i, : len(r.block_ids)] = r.block_ids
    req_of_token = np.repeat(np.arange(num_reqs), q_lens)
    slot_mapping = block_tables[req_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens = starts + q_lens
    sample_rows = [i for i, r in enumerate(reqs) if r.sample]
    logits_indices = cu[1:][sample_rows] - 1 if sample_rows else np.zeros(0, dtype=np.int64)
    md = AttentionMetadata(
        num_reqs=num_reqs,
        num_tokens=total,
        query_start_loc=torch.from_numpy(cu),
        seq_lens=torch.from_numpy(seq_lens),
        query_lens=q_lens.tolist(),
        seq_lens_list=seq_lens.tolist(),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_tables=torch.from_numpy(block_tables),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        block_size=block_size,
    )
    return ModelInput(
        input_ids=torch.from_numpy(token_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn_metadata=md,
        logits_indices=torch.from_numpy(np.asarray(logits_indices)).to(device),
        sample_req_ids=[reqs[i].req_id for i in sample_rows],
    )
