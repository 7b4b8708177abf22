"""transformers' StaticCache keeps its length in a device tensor, which its mask requests pass as ``q_offset``: an
accelerated model never reads it on the host (a sync per forward in eager, a data-dependent op under transformers'
compile) and computes what transformers does. Counted as tests/speculative/host_reads.py counts: what would make the
host wait for the GPU on CUDA."""

import pytest
import torch
from transformers import StaticCache

import hfaccel
from hfaccel.attention.paths import FLASH, TORCH
from tests.models import model_cache, padded_batch, tiny_model
from tests.speculative.host_reads import HostReads, counting


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: static sliding-window layers beside full ones
def test_static_cache_decode_steps_read_nothing_on_the_host(arch):
    """generate() on a static cache: each decode step's mask (made in prepare_inputs_for_generation) and forward
    read nothing on the host, and the tokens are transformers'."""
    model = tiny_model(arch)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    expected = model.generate(**batch, **kwargs)
    hfaccel.accelerate(model, attention="torch")
    masks, forwards = [], []
    model.prepare_inputs_for_generation = counting(model.prepare_inputs_for_generation, masks)
    model.forward = counting(model.forward, forwards)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
    steps = [mask.reads + forward.reads for mask, forward in zip(masks, forwards)]
    assert len(steps) == 5 and steps[1:] == [[]] * 4, steps  # after the prefill (whose cache is empty)


def test_queries_at_a_device_offset_give_transformers_logits():
    """A filled static cache, then a chunk of 6 queries and a decode step (offsets on the device): the chunk on the
    dense mask built on the device, the decode step on hfaccel's kernel with its causal rule as key padding; no host
    read, transformers' logits on every real token."""
    model = tiny_model("llama")
    batch = padded_batch()
    expected, _ = _prefill_chunk_and_decode(model, batch)
    hfaccel.accelerate(model, attention="triton")
    got, paths = _prefill_chunk_and_decode(model, batch)
    real = batch["attention_mask"].bool()
    for step, (want, have, where) in enumerate(zip(expected, got, (real[:, :5], real[:, 5:], real[:, -1:]))):
        torch.testing.assert_close(have[where], want[where], atol=1e-5, rtol=1e-5, msg=f"step {step}")
    assert paths[1:] == [([], TORCH), ([], f"{FLASH} (triton)")], paths


def _prefill_chunk_and_decode(model, batch: dict) -> tuple[list[torch.Tensor], list[tuple[list[str], str | None]]]:
    """Logits of a prefill of 5 tokens, a chunk of the next 6 and one decode step on a StaticCache, and per forward
    its host reads and the attention path that served it last (accelerated models)."""
    cache = StaticCache(config=model.config, max_cache_len=24)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    steps = [(ids[:, :5], mask[:, :5]), (ids[:, 5:], mask), (ids[:, -1:], torch.cat([mask, mask[:, -1:]], 1))]
    logits, paths = [], []
    with torch.no_grad():
        for input_ids, attention_mask in steps:
            with HostReads() as waits:
                logits.append(
                    model(
                        input_ids=input_ids, attention_mask=attention_mask, **model_cache(model, cache), use_cache=True
                    ).logits
                )
            paths.append((waits.reads, _last_path(model)))
    return logits, paths


def _last_path(model) -> str | None:
    return model.hfaccel.attention_paths.last if hasattr(model, "hfaccel") else None
