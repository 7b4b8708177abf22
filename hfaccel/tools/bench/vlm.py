"""``hfaccel bench vlm``: a vision-language model — Qwen2.5-VL-3B's shapes with random weights (speed does not depend
on the weights' values; ``--model tiny`` a 2-layer one, to try the case on a CPU), one image of 448×448 per prompt.

1. Decode after a one-image prompt, batch 1: transformers sdpa, transformers static cache + torch.compile, and
   ``hfaccel.accelerate(model)``; a decode step's time is ``(t(N new tokens) - t(1 new token)) / (N - 1)`` (the
   prompt's prefill, its image encoded, cancels out); the ratio divides by the fastest transformers path that ran.
2. Serving: ``--requests`` requests (64) of one image each and ``--new-tokens`` answers (64): transformers'
   ``generate`` over the same requests in padded batches of ``--batch`` (16) against ``hfaccel.Engine`` (prompts a
   processor made, ``{"prompt_token_ids", "multimodal_inputs"}``: Qwen2.5-VL's processor needs torchvision, its image
   processor alone does not) — output tokens/s and the ratio. Each path runs once to warm up, then once timed.

Goals on a GPU (issue 49): decode ≥ 1.5× transformers' static cache + compile (or its fastest path that runs);
serving ≥ 5× transformers' padded batches. Not part of "all": it builds a 3.8B-parameter model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from hfaccel.engine import Engine
from hfaccel.hf import accelerate, restore
from hfaccel.runner.step_function import failure_reason
from hfaccel.sampling import SamplingParams
from hfaccel.tools.bench.decode import STATIC_COMPILE
from hfaccel.tools.bench.timing import sync, table

IMAGE, IMAGE_START, IMAGE_END, VIDEO = 151655, 151652, 151653, 151656  # Qwen2.5-VL's special tokens
IMAGE_SIDE = 448
QUESTION = 16  # text tokens before and after the image


def qwen2_5_vl_config(name: str):
    """Qwen2.5-VL-3B-Instruct's config (``"qwen2.5-vl-3b"``), or a tiny one of the same structure (``"tiny"``)."""
    from transformers import Qwen2_5_VLConfig

    if name == "tiny":
        text = dict(
            vocab_size=151936,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6},
        )
        vision = dict(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[1]
        )
    elif name == "qwen2.5-vl-3b":
        text = dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        )
        vision = dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            fullatt_block_indexes=[7, 15, 23, 31],
        )
    else:
        raise ValueError(f"bench vlm: --model is 'qwen2.5-vl-3b' (the default) or 'tiny'; got {name!r}")
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112)
    return Qwen2_5_VLConfig(
        text_config={**text, "max_position_embeddings": 32768},
        vision_config=vision,
        image_token_id=IMAGE,
        vision_start_token_id=IMAGE_START,
        vision_end_token_id=IMAGE_END,
        video_token_id=VIDEO,
    )


def one_image_prompt(processor, seed: int) -> dict[str, torch.Tensor]:
    """``generate`` inputs of one prompt: random text, a random 448×448 image, random text (batch of one)."""
    rng = np.random.RandomState(seed)
    pixels = processor(images=[rng.randint(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)], return_tensors="pt")
    image_tokens = int(pixels["image_grid_thw"][0].prod()) // 4
    ids = [
        *rng.randint(3, 150000, QUESTION),
        IMAGE_START,
        *[IMAGE] * image_tokens,
        IMAGE_END,
        *rng.randint(3, 150000, QUESTION),
    ]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == IMAGE).int(),
        **pixels,
    }


def batched(prompts: list[dict]) -> dict[str, torch.Tensor]:
    """Prompts of one length (one image each, the same size) as one batch."""
    return {
        "input_ids": torch.cat([p["input_ids"] for p in prompts]),
        "attention_mask": torch.cat([p["attention_mask"] for p in prompts]),
        "mm_token_type_ids": torch.cat([p["mm_token_type_ids"] for p in prompts]),
        "pixel_values": torch.cat([p["pixel_values"] for p in prompts]),
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in prompts]),
    }


def on(inputs: dict, device: torch.device, dtype: torch.dtype) -> dict:
    return {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in inputs.items()}


@dataclass
class DecodeRow:
    path: str
    ms_per_step: float
    tokens_per_s: float
    vs_baseline: float  # tokens_per_s / the fastest transformers path's
    baseline: str


@dataclass
class ServeRow:
    path: str
    requests: int
    new_tokens: int
    seconds: float
    output_tokens_per_s: float
    vs_transformers: float


def _generate_seconds(model, inputs: dict, new_tokens: int, kwargs: dict) -> float:
    """Wall seconds of a greedy generate() of exactly ``new_tokens`` tokens, after one untimed call."""
    args = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    model.generate(**inputs, **args)
    sync(inputs["input_ids"].device)
    start = time.perf_counter()
    model.generate(**inputs, **args)
    sync(inputs["input_ids"].device)
    return time.perf_counter() - start


def decode_rows(model, inputs: dict, new_tokens: int, device: torch.device, failures: dict) -> list[DecodeRow]:
    from transformers import CompileConfig

    paths = {"transformers sdpa": {}}
    if device.type == "cuda":
        paths[STATIC_COMPILE] = dict(cache_implementation="static", compile_config=CompileConfig())
    paths["hfaccel"] = {}
    measured = {}
    for path, kwargs in paths.items():
        restore(model)
        if path == "hfaccel":
            accelerate(model)
        try:
            full = _generate_seconds(model, inputs, new_tokens, kwargs)
            prefill = _generate_seconds(model, inputs, 1, kwargs)
        except Exception as error:  # a path that cannot run the model: the others are still measured
            failures[f"decode {path}"] = failure_reason(error)
            continue
        measured[path] = max(full - prefill, 1e-9) / (new_tokens - 1) * 1e3
    restore(model)
    theirs = {path: ms for path, ms in measured.items() if path.startswith("transformers")}
    baseline = min(theirs, key=theirs.get)
    return [DecodeRow(path, ms, 1e3 / ms, theirs[baseline] / ms, baseline) for path, ms in measured.items()]


def serve_rows(
    model, prompts: list[dict], new_tokens: int, batch: int, device: torch.device, dtype: torch.dtype
) -> list[ServeRow]:
    """transformers' padded batches against the Engine over the same requests."""

    def transformers_run() -> None:
        for start in range(0, len(prompts), batch):
            model.generate(
                **on(batched(prompts[start : start + batch]), device, dtype),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    restore(model)
    seconds = {"transformers generate (padded batches of %d)" % batch: _timed(transformers_run, device)}
    engine = Engine(model, max_num_seqs=len(prompts), max_num_batched_tokens=16384)
    requests = [
        {
            "prompt_token_ids": p["input_ids"][0].tolist(),
            "multimodal_inputs": on(
                {k: v for k, v in p.items() if k not in ("input_ids", "attention_mask")}, device, dtype
            ),
        }
        for p in prompts
    ]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seconds["hfaccel Engine"] = _timed(lambda: engine.generate(requests, params), device)
    engine.close()
    restore(model)
    baseline = next(iter(seconds.values()))
    tokens = len(prompts) * new_tokens
    return [ServeRow(path, len(prompts), new_tokens, s, tokens / s, baseline / s) for path, s in seconds.items()]


def _timed(run, device: torch.device) -> float:
    run()  # warm-up: compiles, captures, fills the encoder cache of a first run
    sync(device)
    start = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - start


def run(options, console) -> dict:
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    name = options.model or ("qwen2.5-vl-3b" if options.cuda else "tiny")
    dtype = torch.bfloat16 if torch.bfloat16 in options.dtypes else options.dtypes[0]
    with torch.device(options.device):
        model = Qwen2_5_VLForConditionalGeneration(qwen2_5_vl_config(name)).to(dtype).eval()
    processor = Qwen2VLImageProcessorPil()
    failures: dict[str, str] = {}
    prompts = [one_image_prompt(processor, seed) for seed in range(options.num_requests or 64)]
    decode = decode_rows(
        model, on(prompts[0], options.device, dtype), options.new_tokens or 128, options.device, failures
    )
    serve = serve_rows(model, prompts, options.new_tokens or 64, (options.batches or [16])[0], options.device, dtype)
    decode, serve = [asdict(r) for r in decode], [asdict(r) for r in serve]
    title = f"vlm: {name} {str(dtype).removeprefix('torch.')}, one {IMAGE_SIDE}x{IMAGE_SIDE} image per prompt"
    console.print(
        table(f"{title}: batch-1 decode after the prompt (vs_baseline: the fastest transformers path)", decode)
    )
    for where, reason in failures.items():
        console.print(f"[yellow]could not run {where}: {reason}")
    console.print(table(f"{title}: serving (output tokens/s)", serve))
    return {"vlm_decode": decode, "vlm_serve": serve, "vlm_failures": failures}
