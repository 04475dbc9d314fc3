"""Tiny random-weight checkpoints the worker and serve tiers run, built by the kit itself.

The tokenizer is byte-level with no merges (one token per byte, plus ``<unk>``, ``<s>`` and
``</s>``), written as ``tokenizer.json`` with a plain chat template: no file is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["CHAT_TEMPLATE", "build_tiny_model", "build_tokenizer", "hf_greedy"]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>"]


def build_tokenizer(path: Path):
    # lazy: optional dependency (transformers and tokenizers come with the testing extra)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def build_tiny_model(path: Path, kind: str, seed: int = 0) -> Path:
    """A 2-layer ``kind`` ("llama" or "opt") with random weights, saved as float32 safetensors."""
    # lazy: optional dependency (transformers and tokenizers come with the testing extra)
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    vocab, bos, eos = len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
                tie_word_embeddings=False,
                bos_token_id=bos,
                eos_token_id=eos,
                rope_theta=10000.0,
            )
        )
    elif kind == "opt":
        model = OPTForCausalLM(
            OPTConfig(
                vocab_size=vocab,
                hidden_size=64,
                ffn_dim=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=256,
                word_embed_proj_dim=64,
                bos_token_id=bos,
                eos_token_id=eos,
                pad_token_id=eos,
            )
        )
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; use 'llama' or 'opt'")
    with torch.no_grad():  # larger weights spread the logits, so greedy ties are rare
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF transformers' greedy tokens (float32, no stop on EOS): the worker tier's reference."""
    from transformers import AutoModelForCausalLM  # lazy: optional dependency (the testing extra)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]  # (vocab,)
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]
