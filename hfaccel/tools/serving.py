"""``hfaccel serve``: the model loaded as the options say (int4 checkpoints, image-text-to-text models, quantized at
load), the engine and server configured from them, served on one process or over tensor-parallel ranks."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from hfaccel.tools.commands import calibration_ids


def serve_command(args: argparse.Namespace) -> None:
    """``hfaccel serve``: the options checked, then one process or tensor-parallel ranks."""
    try:
        import hfaccel.serve.server  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"hfaccel serve needs the server extras: pip install 'hfaccel[serve]' ({error})") from None
    from hfaccel.distributed import RankFailed, launched, supervise

    world = launched()
    size = args.tensor_parallel_size or world or 1
    if world is not None and world > 1 and size != world:
        raise SystemExit(
            f"hfaccel serve: --tensor-parallel-size {size} under a launcher of {world} ranks (torchrun); "
            f"give {world}, or leave it out"
        )
    if size < 1:
        raise SystemExit(f"hfaccel serve: --tensor-parallel-size must be at least 1; got {size}")
    if args.lora and size > 1:
        raise SystemExit(
            "hfaccel serve: --lora is not supported with tensor parallelism yet (serve the adapters on "
            "one GPU, or merge an adapter into the model)"
        )
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
    from hfaccel.tools.models import pick_device, pick_dtype

    _show_engine_log()
    device = pick_device(args.device)
    model, tokenizer = load_for_serving(args, device, pick_dtype(args.dtype, device))
    hfaccel.accelerate(model, attention=args.attention, paged=False)
    _serve_engine(args, _engine(args, model, tokenizer))


def _serve_rank(args: argparse.Namespace) -> None:
    """One tensor-parallel rank of ``hfaccel serve`` (the launcher's environment set): the model sharded with
    ``tp_plan="auto"``; rank 0 serves HTTP and schedules, the other ranks follow its steps until it stops."""
    import torch
    from transformers import AutoTokenizer, DistributedConfig

    import hfaccel
    from hfaccel.distributed.launch import backend_for, init_ranks
    from hfaccel.tools.models import pick_device, pick_dtype

    if os.environ["RANK"] == "0":  # the others' lines would repeat it (the KV budget is agreed)
        _show_engine_log()
    device = pick_device(args.device)
    if device.type == "cpu" and torch.cuda.is_available():
        raise SystemExit(
            "hfaccel serve: tensor parallelism shards the model over transformers' accelerator (CUDA "
            "here), one GPU per rank; --device cpu is not supported with --tensor-parallel-size"
        )
    _check_tp_quantization(args)
    init_ranks(backend_for(device))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model, tokenizer = _load_model(
        args.model, pick_dtype(args.dtype, device), tokenizer, distributed_config=DistributedConfig(tp_plan="auto")
    )
    model.eval()
    hfaccel.accelerate(model, attention=args.attention, paged=False, quantize=args.quantize, group_size=args.group_size)
    engine = _engine(args, model, tokenizer)
    if engine.is_leader:
        _serve_engine(args, engine)
    else:
        engine.follow()


def _show_engine_log() -> None:
    """hfaccel's INFO lines on stderr, as uvicorn writes its own: a server says at start-up what KV memory its engine
    reserved and how its decode steps run. Only the ``hfaccel`` logger is set (not the root logger, nor
    transformers' or torch's): the library itself adds no handler, and ``Engine`` stays quiet unless its user
    configures logging."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log = logging.getLogger("hfaccel")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # a root handler someone adds would print each line twice


def _serve_engine(args: argparse.Namespace, engine) -> None:
    """Serve ``engine`` over HTTP until SIGTERM / SIGINT. When its engine thread ends (the device lost, the TP ranks
    diverged, a bug), the server drains as on SIGTERM and the process exits with status 1 — not a server that
    answers every request with an error — so its supervisor restarts it (under tensor parallelism rank 0's
    followers would wait for its next step forever: its launcher, or torchrun, then stops every rank)."""
    import hfaccel
    from hfaccel.serve.server import serve

    failures: list[BaseException] = []

    def stop_serving(error: BaseException) -> None:
        failures.append(error)
        os.kill(os.getpid(), signal.SIGTERM)

    async_engine = hfaccel.AsyncEngine(engine, on_failure=stop_serving)
    try:
        serve(
            async_engine,
            _server_config(args),
            host=args.host,
            port=args.port,
            graceful_shutdown_s=args.graceful_shutdown,
        )
    except SystemExit:
        if not failures:
            raise
    finally:  # also on SIGTERM's SystemExit: the engine thread stops first, then the followers
        async_engine.shutdown()
        engine.shutdown()
    if failures:
        raise SystemExit(f"hfaccel serve: the engine stopped: {failures[0]!r}")


def _check_tp_quantization(args: argparse.Namespace) -> None:
    method = _settings(args.model).get("quantization_config", {}).get("quant_method")
    if method is not None:
        raise SystemExit(
            f"hfaccel serve: a {method} checkpoint cannot be served with --tensor-parallel-size (int4 "
            "under tensor parallelism: serve the full-precision model with --quantize rtn)"
        )
    if args.quantize not in (None, "rtn"):
        raise SystemExit(
            f"hfaccel serve: --quantize {args.quantize} calibrates on one process; with "
            "--tensor-parallel-size only --quantize rtn is supported"
        )


def _engine(args: argparse.Namespace, model, tokenizer):
    import hfaccel

    loras = lora_adapters(args)
    lora = (
        {}
        if loras is None
        else {"lora_adapters": loras, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    )
    try:
        return hfaccel.Engine(
            model,
            tokenizer,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_blocks=args.num_blocks,
            kv_cache_memory=None if args.kv_cache_gib is None else int(args.kv_cache_gib * (1 << 30)),
            kv_cache_fraction=args.kv_cache_fraction,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_scales=args.kv_scales,
            max_model_len=args.max_model_len,
            cuda_graphs=args.cuda_graphs,
            compile="auto" if args.compile is None else args.compile,
            async_scheduling=args.async_scheduling,
            **lora,
        )
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
            raise SystemExit(
                f"hfaccel serve: --lora takes NAME=PATH (a name for the adapter, its PEFT folder); got {option!r}"
            )
        if name in adapters or name == served:
            raise SystemExit(
                f"hfaccel serve: --lora name {name!r} is "
                + (
                    "given twice"
                    if name in adapters
                    else "the served model's own name (--served-model-name): requests could not pick the base"
                )
            )
        adapters[name] = path
    return adapters


def _server_config(args: argparse.Namespace):
    from hfaccel.serve.server import ServerConfig

    return ServerConfig(
        args.served_model_name or args.model,
        api_key=args.api_key,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout or None,
        read_timeout=args.read_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_origins=tuple(args.allowed_origins),
        max_stored_responses=args.max_stored_responses,
        allowed_media_domains=tuple(d.lower() for d in args.allowed_media_domains),
    )


def load_for_serving(args: argparse.Namespace, device, dtype):
    """(model, tokenizer) of ``args.model``: an int4 checkpoint through hfaccel.load_quantized; an image-text-to-text
    model with its processor (in the tokenizer's place: the engine takes prompts with images through it); else a
    causal LM; quantized with ``--quantize`` if asked."""
    from pathlib import Path

    from transformers import AutoTokenizer

    import hfaccel

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    method = _settings(args.model).get("quantization_config", {}).get("quant_method")
    if method in ("awq", "gptq"):
        return hfaccel.load_quantized(args.model, dtype=dtype, device=device), tokenizer
    model, tokenizer = _load_model(args.model, dtype, tokenizer)
    model = model.to(device)
    if args.quantize:
        calib = None
        if args.quantize != "rtn":
            from hfaccel.tools.assets import shakespeare_text

            text = Path(args.calib).read_text() if args.calib else shakespeare_text("hamlet")
            calib = calibration_ids(getattr(tokenizer, "tokenizer", tokenizer), text, 64, 512)
        hfaccel.quantize(model, args.quantize, calib_data=calib, group_size=args.group_size, calib_device=device)
    return model.eval(), tokenizer


def _settings(path: str) -> dict:
    """The checkpoint's config.json (empty where there is none: a hub name)."""
    import json
    from pathlib import Path

    config = Path(path) / "config.json"
    return json.loads(config.read_text()) if config.exists() else {}


def _load_model(path: str, dtype, tokenizer, **options):
    """(model, tokenizer) of a checkpoint: an image-text-to-text model with its processor in the tokenizer's place
    (:func:`_load_image_text_to_text`), else a causal LM; ``options`` go to ``from_pretrained`` (a TP rank's
    ``distributed_config``)."""
    from transformers import AutoModelForCausalLM

    if _settings(path).get("model_type") in _image_text_to_text_types():
        return _load_image_text_to_text(path, dtype, tokenizer, **options)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **options), tokenizer


def _image_text_to_text_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _load_image_text_to_text(path: str, dtype, tokenizer, **options):
    """(model, its processor) of an image-text-to-text checkpoint; the tokenizer alone, and a warning, when the
    processor cannot be loaded (the server then takes text only)."""
    import logging

    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **options)
    try:
        return model, AutoProcessor.from_pretrained(path)
    except Exception as error:  # a processor that needs what is not installed (torchvision, ...)
        logging.getLogger("hfaccel").warning(
            "hfaccel serve: the processor of %s could not be loaded (%s: %s); serving text prompts only",
            path,
            type(error).__name__,
            error,
        )
        return model, tokenizer
