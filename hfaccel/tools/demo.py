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


ROUNDS = 3  # timed rounds of plain and accelerated generate(), interleaved; each path's best counts


def timed_generate(model, tokenizer, batch, max_new_tokens: int, label: str) -> Run:
    """One generate() call, timed after a short warm-up call (kernels compile, caches fill)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    model.generate(**batch, **{**kwargs, "max_new_tokens": 4})
    _sync(batch["input_ids"])
    start = time.perf_counter()
    out = model.generate(**batch, **kwargs)
    _sync(out)
    seconds = time.perf_counter() - start
    new = out[:, batch["input_ids"].shape[1] :]
    new_tokens = int((new != tokenizer.pad_token_id).sum()) if tokenizer.pad_token_id is not None else new.numel()
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    return Run(label, texts, max(new_tokens, 1), seconds)


def _sync(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def run_demo(
    model_name: str | None = None,
    prompts: list[str] | None = None,
    max_new_tokens: int = 48,
    device: str = "auto",
    dtype: str = "auto",
    attention: str = "auto",
    rounds: int = ROUNDS,
    console: Console | None = None,
    compile: bool | str = "auto",
) -> tuple[Run, Run]:
    """Generate with plain transformers and with ``hfaccel.accelerate(model, attention=..., compile=...)``,
    interleaved over ``rounds`` rounds (each path's fastest run counts: not a first call's compiling); print both
    texts, the speeds and the paths that served hfaccel's calls."""
    console = console or Console()
    torch_device = pick_device(device)
    model, tokenizer = load(model_name, torch_device, pick_dtype(dtype, torch_device), console)
    batch = encode(tokenizer, list(prompts or DEFAULT_PROMPTS), torch_device)
    runs: dict[bool, list[Run]] = {False: [], True: []}  # accelerated or not -> its runs
    with console.status(f"generating {max_new_tokens} tokens, plain and accelerated, {rounds} rounds"):
        for round_ in range(rounds):
            for accelerated in (False, True) if round_ % 2 == 0 else (True, False):  # A B, B A, ...: no order wins
                if accelerated:
                    hfaccel.accelerate(model, attention=attention, compile=compile)
                    label = f"hfaccel ({_backend_label(model)})"
                else:
                    hfaccel.restore(model)
                    label = "transformers (sdpa)"
                runs[accelerated].append(timed_generate(model, tokenizer, batch, max_new_tokens, label))
    if not hasattr(model, "hfaccel"):
        # restored last: accelerated again for the report
        hfaccel.accelerate(model, attention=attention, compile=compile)
    plain, accelerated = (min(runs[key], key=lambda run: run.seconds) for key in (False, True))
    _print(console, list(prompts or DEFAULT_PROMPTS), plain, accelerated, model)
    return plain, accelerated


def _backend_label(model) -> str:
    from hfaccel.kernels import resolve_backend

    info = model.hfaccel
    if not info.active:
        return "not accelerated"
    device = next(model.parameters()).device
    if info.attention == "auto" and resolve_backend("auto", device) == "torch":
        compiled = ", static cache, compiled forward" if info.compile is True else ""
        return f"transformers' sdpa and loop on {device.type}{compiled}"
    return f"{resolve_backend(info.attention, device)} kernels on {device.type}"


def same_path_as_transformers(model) -> bool:
    """Whether the accelerated model runs what plain transformers runs here: where hfaccel's kernels do not run
    (the CPU, MPS), ``auto`` keeps transformers' SDPA and loop, so a ratio of the two would only time noise."""
    from hfaccel.kernels import resolve_backend

    info = model.hfaccel
    device = next(model.parameters()).device
    return not info.active or (
        info.attention == "auto" and resolve_backend("auto", device) == "torch" and info.compile is not True
    )


def _print(console: Console, prompts: list[str], plain: Run, accelerated: Run, model) -> None:
    for index, prompt in enumerate(prompts):
        console.rule(f"prompt {index + 1}: {prompt}")
        for run in (plain, accelerated):
            console.print(f"[bold]{run.label}[/]: {run.texts[index].strip()}")
    table = Table(
        title=f"{type(model).__name__}, {model.dtype}, {next(model.parameters()).device} "
        f"(best of the interleaved rounds)"
    )
    for column in ("path", "new tokens", "seconds", "tokens/s", "vs transformers"):
        table.add_column(column, justify="right" if column != "path" else "left")
    same = same_path_as_transformers(model)
    for run in (plain, accelerated):
        ratio = f"{run.tokens_per_second / plain.tokens_per_second:.2f}x"
        table.add_row(
            run.label,
            str(run.new_tokens),
            f"{run.seconds:.2f}",
            f"{run.tokens_per_second:.1f}",
            "same path" if same and run is accelerated else ratio,
        )
    console.print(table)
    if same:
        console.print(
            "both rows ran the same path as transformers on this device (any difference is noise); the "
            "paths that differ here: --compile true (transformers' static cache and compiled forward), "
            "and on a CUDA GPU hfaccel's kernels and decode loop"
        )
    verdict = "[green]identical[/]" if plain.texts == accelerated.texts else "[red]DIFFERENT[/]"
    console.print(f"generated text: {verdict}")
    info = model.hfaccel
    console.print(f"served by: decode loop {info.decode}; attention {info.attention_paths}")
