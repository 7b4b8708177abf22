"""``hfaccel demo``: the same generate() call on a real model, plain transformers vs ``hfaccel.accelerate``."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

import hfaccel
from hfaccel.tools.models import encode, load, pick_device, pick_dtype

DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.")


@dataclass
class Run:
    """One timed generate() call."""

    label: str
    texts: list[str]
    new_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def timed_generate(model, tokenizer, batch, max_new_tokens: int, label: str) -> Run:
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if batch["input_ids"].is_cuda:
        model.generate(**batch, **{**kwargs, "max_new_tokens": 4})  # warm-up: kernels compile, caches fill
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(**batch, **kwargs)
    if out.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1]:]
    new_tokens = int((new != tokenizer.pad_token_id).sum()) if tokenizer.pad_token_id is not None else new.numel()
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return Run(label, texts, max(new_tokens, 1), seconds)


def run_demo(model_name: str | None = None, prompts: list[str] | None = None, max_new_tokens: int = 48,
             device: str = "auto", dtype: str = "auto", attention: str = "auto",
             console: Console | None = None) -> tuple[Run, Run]:
    """Generate with plain transformers, then with ``hfaccel.accelerate(model)``; print both and compare."""
    console = console or Console()
    torch_device = pick_device(device)
    model, tokenizer = load(model_name, torch_device, pick_dtype(dtype, torch_device), console)
    batch = encode(tokenizer, list(prompts or DEFAULT_PROMPTS), torch_device)
    plain = timed_generate(model, tokenizer, batch, max_new_tokens, "transformers (sdpa)")
    hfaccel.accelerate(model, attention=attention)
    accelerated = timed_generate(model, tokenizer, batch, max_new_tokens, f"hfaccel ({_backend_label(model)})")
    _print(console, list(prompts or DEFAULT_PROMPTS), plain, accelerated, model)
    return plain, accelerated


def _backend_label(model) -> str:
    from hfaccel.kernels import resolve_backend

    info = model.hfaccel
    if not info.active:
        return "not accelerated"
    device = next(model.parameters()).device
    return f"{resolve_backend(info.attention, device)} kernels on {device.type}"


def _print(console: Console, prompts: list[str], plain: Run, accelerated: Run, model) -> None:
    for index, prompt in enumerate(prompts):
        console.rule(f"prompt {index + 1}: {prompt}")
        for run in (plain, accelerated):
            console.print(f"[bold]{run.label}[/]: {run.texts[index].strip()}")
    table = Table(title=f"{type(model).__name__}, {model.dtype}, {next(model.parameters()).device}")
    for column in ("path", "new tokens", "seconds", "tokens/s"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for run in (plain, accelerated):
        table.add_row(run.label, str(run.new_tokens), f"{run.seconds:.2f}", f"{run.tokens_per_second:.1f}")
    console.print(table)
    same = plain.texts == accelerated.texts
    verdict = "[green]identical[/]" if same else "[red]DIFFERENT[/]"
    console.print(f"generated text: {verdict}; {model.hfaccel}")
    if model.device.type != "cuda":
        console.print("(no CUDA device: hfaccel ran its CPU path; speed-ups are a GPU matter)")
