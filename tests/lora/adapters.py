"""PEFT LoRA adapters of the tiny test models, saved as PEFT saves them, and PEFT's own greedy tokens."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 9, 20, 33, 41, 7, 12], [60, 3, 3, 17], list(range(10, 31)), [88, 4, 71, 23, 9, 15, 50, 6, 44, 31, 2 + 1]]
NEW_TOKENS = 10


def save_adapter(base: torch.nn.Module, path: Path, *, r: int, seed: int, boost: float = 8.0, **config) -> PeftModel:
    """A random LoRA adapter of ``base`` (every projection unless ``target_modules`` says otherwise) saved into
    ``path``; returns PEFT's model with it active. ``boost`` scales the B matrices up so that each adapter's greedy
    tokens differ from the base model's and from each other's."""
    torch.manual_seed(seed)
    config = {"target_modules": TARGETS, "lora_alpha": 2 * r, "init_lora_weights": False, **config}
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, **config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(boost)
    model.save_pretrained(path)
    return model


def greedy_tokens(model, prompts=PROMPTS, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Each prompt's own greedy ``generate`` (no EOS: fixed lengths)."""
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def rewrite_tensors(src: Path, dst: Path, change) -> Path:
    """A copy of the adapter ``src`` in ``dst`` whose tensors are ``change(tensors)``."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    save_file(change(load_file(src / "adapter_model.safetensors")), dst / "adapter_model.safetensors")
    return dst
