"""The ``hfaccel`` commands other than ``serve`` (``hfaccel.tools.serving``): each takes the parsed options and
imports what it needs when it runs, so that ``hfaccel --help`` loads no model code."""

from __future__ import annotations

import argparse

from hfaccel.tools.bench import CASES

BENCH_CASES = ("all",) + CASES


def demo_command(args: argparse.Namespace) -> None:
    """``hfaccel demo``: plain transformers and hfaccel side by side."""
    from hfaccel.tools.demo import run_demo

    compile = {"auto": "auto", "true": True, "false": False}[args.compile]
    run_demo(args.model, args.prompt, args.max_new_tokens, args.device, args.dtype, args.attention, compile=compile)


def generate_command(args: argparse.Namespace) -> None:
    """``hfaccel generate``: the prompts' greedy continuations, printed."""
    from rich.console import Console

    import hfaccel
    from hfaccel.tools.models import encode, load, pick_device, pick_dtype

    console = Console()
    device = pick_device(args.device)
    model, tokenizer = load(args.model, device, pick_dtype(args.dtype, device), console)
    hfaccel.accelerate(model, attention=args.attention)
    batch = encode(tokenizer, args.prompt, device)
    out = model.generate(
        **batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    for text in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True):
        console.print(text.strip())


def bench_command(args: argparse.Namespace) -> None:
    """``hfaccel bench``: the cases asked for (``--serve`` adds the server's)."""
    from hfaccel.tools.bench import run_bench

    unknown = sorted(set(args.what) - set(BENCH_CASES))
    if unknown:
        raise SystemExit(f"hfaccel bench: unknown case(s) {unknown}; choose from {', '.join(BENCH_CASES)}")
    what = args.what or ([] if args.serve else ["all"])
    if args.serve:
        what.append("serve")
    run_bench(
        what,
        args.model,
        args.device,
        args.dtype,
        args.batch,
        args.prompt_len,
        args.new_tokens,
        args.output,
        draft=args.draft,
        num_draft_tokens=args.num_draft_tokens,
        num_requests=args.requests,
        url=args.url,
        host=args.host,
        tokenizer=args.tokenizer,
        tensor_parallel_size=args.tensor_parallel_size,
        profile=args.profile,
        layers=args.layers,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def tune_command(args: argparse.Namespace) -> None:
    """``hfaccel tune``: this GPU's kernel table; a bad model or op name stops with a message."""
    import torch

    from hfaccel.tools.tune import DEFAULT_MODELS, tune

    try:
        dtypes = [getattr(torch, name) for name in args.dtype] if args.dtype else None
        tune(args.model or DEFAULT_MODELS, args.op, args.device, args.output, m_buckets=args.m, dtypes=dtypes)
    except ValueError as error:
        raise SystemExit(f"hfaccel tune: {error}") from None


def quantize_command(args: argparse.Namespace) -> None:
    """``hfaccel quantize``: an int4 checkpoint written in the asked format."""
    from pathlib import Path

    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfaccel
    from hfaccel.tools.models import pick_device

    console = Console()
    fmt = args.format or ("gptq" if args.method == "gptq" else "awq")
    if args.act_order and fmt != "gptq":
        raise SystemExit("--act-order needs --format gptq (AWQ files have no activation order)")
    if args.method != "rtn" and not args.calib:
        raise SystemExit(f"--method {args.method} needs --calib TEXTFILE")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float16).eval()
    calib = calibration_ids(tokenizer, Path(args.calib).read_text(), args.samples, args.seq_len) if args.calib else None
    device = pick_device(args.device)
    hfaccel.quantize(
        model, args.method, calib_data=calib, group_size=args.group_size, act_order=args.act_order, calib_device=device
    )
    hfaccel.save_quantized(model, args.out, format=fmt, tokenizer=tokenizer)
    console.print(f"wrote {fmt} checkpoint to {args.out} ({args.method}, group size {args.group_size})")


def calibration_ids(tokenizer, text: str, samples: int, seq_len: int):
    """``[samples, seq_len]`` token ids taken at evenly spaced offsets of ``text``."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if len(ids) < seq_len:
        raise SystemExit(f"the calibration text has {len(ids)} tokens; --seq-len {seq_len} needs at least that many")
    starts = torch.linspace(0, len(ids) - seq_len, samples).long().unique()
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
