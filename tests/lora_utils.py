"""Random LoRA adapters made with ``peft`` itself, and HF + ``peft`` greedy references."""

from __future__ import annotations

from pathlib import Path

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OPT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def build_adapter(base: Path, path: Path, targets: list[str], r: int = 8, alpha: int = 16, seed: int = 1,
                  std: float = 0.2) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (std ``std``: large enough to change the
    greedy tokens), saved in ``path``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if (path / "adapter_config.json").exists():
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


def hf_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens of HF transformers in fp32, with ``adapter`` applied through ``PeftModel``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(ids):].tolist())
    return out
