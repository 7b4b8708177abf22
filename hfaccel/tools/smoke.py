"""``python -m hfaccel.tools.smoke``: the real-size probe of ``make gpu-smoke`` — how an accelerated model's decode
steps run on this device, in one table.

A model built from a named real config (random weights: what is probed is compiling, capturing and the time of a
step, not the tokens) is accelerated with the defaults, then ``generate`` runs at each batch size. Per batch: the
milliseconds per decode step, which loop served, the graphs dynamo compiled so far (``unique_graphs``, which must
not grow after the first batches: one compiled step per model), and the decode steps' status (compiled or not,
the sizes captured as CUDA graphs, every fallback's reason). An Engine is then built (it compiles and captures its
ladder while it is built: the time is printed) and stepped at the same batch sizes.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from hfaccel.hf import accelerate
from hfaccel.tools.bench.timing import sync
from hfaccel.tools.models import NAMED_CONFIGS, build_model, pick_device, pick_dtype

PROMPT_LEN = 128
NEW_TOKENS = 32


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _generate_row(model, batch: int, vocab: int) -> list[str]:
    """generate() at ``batch`` rows, timed after a first call that compiles and captures what it needs:
    [batch, ms per step, loop, compiled graphs, steps]."""
    ids = torch.randint(3, vocab, (batch, PROMPT_LEN), device=model.device)
    times = []
    for new_tokens in (NEW_TOKENS, 1, NEW_TOKENS):
        sync(model.device)
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        sync(model.device)
        times.append(time.perf_counter() - start)
    step_ms = (times[2] - times[1]) / (NEW_TOKENS - 1) * 1e3
    return [
        str(batch),
        f"{step_ms:.2f}",
        str(model.hfaccel.decode),
        str(_graphs_compiled()),
        model.hfaccel.session.steps(),
    ]


def _engine_rows(model, batches: list[int], vocab: int, console: Console) -> list[list[str]]:
    from hfaccel.engine import Engine, SamplingParams

    start = time.perf_counter()
    engine = Engine(model, max_num_seqs=max(batches), max_model_len=PROMPT_LEN + NEW_TOKENS + 16)
    console.print(
        f"Engine built in {time.perf_counter() - start:.1f} s (compiling and capturing its ladder): "
        f"{engine.stats()['decode_steps']}"
    )
    rows = []
    for batch in batches:
        prompts = [torch.randint(3, vocab, (PROMPT_LEN,)).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        sync(model.device)
        start = time.perf_counter()
        engine.generate(prompts, params)
        sync(model.device)
        ms = (time.perf_counter() - start) / NEW_TOKENS * 1e3
        rows.append(
            [
                f"engine {batch}",
                f"{ms:.2f} (incl. prefill)",
                "engine",
                str(_graphs_compiled()),
                engine.stats()["decode_steps"],
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", choices=sorted(NAMED_CONFIGS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1, 4, 16)")
    args = parser.parse_args(argv)
    console = Console()
    device = pick_device(args.device)
    model = build_model(args.model, device, pick_dtype(args.dtype, device))
    vocab = model.config.vocab_size
    accelerate(model)
    batches = args.batch or [1, 4, 16]
    table = Table(title=f"hfaccel smoke: {args.model} on {device} ({model.dtype})")
    for column in ("batch", "ms / decode step", "loop", "graphs compiled", "decode steps"):
        table.add_column(column)
    for batch in batches:
        table.add_row(*_generate_row(model, batch, vocab))
    for row in _engine_rows(model, batches, vocab, console):
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
