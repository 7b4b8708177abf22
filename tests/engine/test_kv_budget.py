"""The engine's default KV pool: what it is configured to serve, capped so that another engine still fits; what it
reserved is said in ``stats()`` and logged."""

import logging

import pytest
import torch

import hfaccel
import hfaccel.engine.kv_budget as kv_budget
from hfaccel import Engine, SamplingParams
from hfaccel.engine.kv_budget import CPU_POOL_BYTES, activation_reserve, plan_kv_cache
from hfaccel.kv.layout import model_layout
from tests.models import tiny_model

GIB = 1 << 30


def _plan(model, **kwargs):
    settings = dict(block_size=16, max_num_seqs=8, max_model_len=256, max_num_batched_tokens=512)
    return plan_kv_cache(model, **{**settings, **kwargs})


def test_two_default_engines_in_one_process_both_serve():
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    first, second = Engine(model), Engine(model)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for engine in (first, second):
        assert len(engine.generate([5, 6, 7], params)[0].outputs[0].token_ids) == 4
        stats = engine.stats()
        assert stats["kv_cache_tokens"] == 64 * 256  # max_num_seqs x max_model_len (max_position_embeddings)
        assert stats["kv_cache_bytes"] == stats["blocks_total"] * engine.runner.pool.block_bytes()


def test_the_reservation_is_logged_but_printed_only_where_logging_is_configured(capfd, caplog):
    """A library adds no handler to its logger: ``Engine`` prints nothing by itself; what it reserved is an INFO
    record of the ``hfaccel`` logger (``hfaccel serve`` shows it) and in ``stats()``."""
    model = hfaccel.accelerate(tiny_model("llama"), attention="torch")
    engine = Engine(model, num_blocks=32)
    assert "hfaccel Engine" not in capfd.readouterr().err and not logging.getLogger("hfaccel").handlers
    with caplog.at_level(logging.INFO, logger="hfaccel"):
        engine = Engine(model, num_blocks=32)
    assert f"hfaccel Engine: {engine.kv_budget}" in caplog.messages
    assert engine.stats()["kv_cache_tokens"] == engine.kv_budget.tokens == 32 * 16


def test_the_pool_holds_what_the_engine_serves_and_is_capped_on_the_cpu():
    model = tiny_model("llama")
    budget = _plan(model)
    assert budget.num_blocks == 8 * 16 and "room for max_num_seqs=8 sequences of max_model_len=256" in str(budget)
    huge = _plan(model, max_num_seqs=4096, max_model_len=1 << 20)
    assert huge.bytes <= CPU_POOL_BYTES < huge.bytes + huge.block_bytes and "capped at 1 GiB" in huge.reason
    assert _plan(model, num_blocks=7).num_blocks == 7
    assert _plan(model, kv_cache_memory=100 * budget.block_bytes + 1).num_blocks == 100


@pytest.mark.parametrize(
    "free, fraction, expected",
    [
        (70 * GIB, 0.5, "fraction"),  # a first engine: half of the device at most
        (30 * GIB, 0.5, "free"),  # a second one: what is free, less its activations
        (80 * GIB, 1.0, "free"),
    ],
)
def test_on_cuda_the_pool_is_capped_by_total_and_free_memory(monkeypatch, free, fraction, expected):
    model = tiny_model("llama")
    monkeypatch.setattr(kv_budget, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GIB))
    budget = _plan(model, max_num_seqs=10**6, max_model_len=1 << 20, kv_cache_fraction=fraction)
    reserve = activation_reserve(model.config, model_layout(model), model.dtype, 512, 10**6)
    limit = {"fraction": int(80 * GIB * fraction), "free": free - reserve}[expected]
    assert budget.num_blocks == limit // budget.block_bytes
    assert ("kv_cache_fraction" if expected == "fraction" else "free") in budget.reason


def test_bad_settings_are_refused(monkeypatch):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="num_blocks or kv_cache_memory, not both"):
        _plan(model, num_blocks=4, kv_cache_memory=GIB)
    with pytest.raises(ValueError, match=r"kv_cache_fraction must be in \(0, 1\]; got 1.5"):
        _plan(model, kv_cache_fraction=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory must hold at least one block"):
        _plan(model, kv_cache_memory=10)
    monkeypatch.setattr(kv_budget, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GIB // 2, 80 * GIB))
    with pytest.raises(RuntimeError, match="no memory is left for a KV cache"):
        _plan(model, max_model_len=1 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 80 * GIB))
    with pytest.raises(RuntimeError, match=r"one block \(\d+ bytes\) does not fit in kv_cache_fraction=1e-12 of"):
        _plan(model, kv_cache_fraction=1e-12)  # not one block anyway, past what the user allowed


def test_latent_attention_reserves_what_it_expands(monkeypatch):
    """MLA read in the latent space expands only one prompt's new tokens (its whole prefill): the engine keeps one
    layer's K/V expanded from one forward's tokens out of the pool. Where it expands every held token at each step
    (an fp8 pool), it keeps those of ``max_num_seqs`` sequences of ``max_model_len`` tokens, so a batch that fills
    the pool does not run out of memory, and refuses to start where they do not fit."""
    import transformers

    from hfaccel.kv.latent import absorbed_layers
    from tests.hf.tiny_configs import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("deepseek_v3", vocab_size=96))
    layout = model_layout(model)
    (expanded,) = {kv.expanded_dim for kv in layout.attention.values()}
    absorbed = absorbed_layers(model, layout)
    assert sorted(absorbed) == sorted(layout.attention)
    per_token = 4 * model.config.num_attention_heads * expanded * 4  # fp32: keys, values, their copy
    plain = activation_reserve(model.config, layout, model.dtype, 512, 8)
    assert activation_reserve(model.config, layout, model.dtype, 512, 8, 4096) == plain + 8 * 4096 * per_token
    assert activation_reserve(model.config, layout, model.dtype, 512, 8, 4096, absorbed) == plain + 512 * per_token
    llama = tiny_model("llama")
    same = activation_reserve(llama.config, model_layout(llama), llama.dtype, 512, 8)
    assert activation_reserve(llama.config, model_layout(llama), llama.dtype, 512, 8, 4096) == same
    monkeypatch.setattr(kv_budget, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * GIB, 80 * GIB))
    assert _plan(model, max_num_seqs=256, max_model_len=1 << 17).num_blocks > 0
    with pytest.raises(RuntimeError, match="no memory is left for a KV cache"):
        _plan(model, max_num_seqs=256, max_model_len=1 << 17, kv_cache_dtype=torch.float8_e4m3fn)


def test_sparse_attention_reserves_its_indexers_bounded_calls():
    """A sparse-attention indexer scores its queries in calls of at most ``INDEXER_BYTES`` and the chosen keys are read
    in chunks of ``GATHER_BYTES``: the engine keeps one of each out of the pool, whatever its context."""
    import dataclasses

    from hfaccel.attention.functions import GATHER_BYTES
    from hfaccel.kv.indexer import INDEXER_BYTES
    from hfaccel.kv.latent import absorbed_layers
    from tests.models import family_model

    model = family_model("deepseek_v32")
    layout = model_layout(model)
    absorbed = absorbed_layers(model, layout)
    assert layout.indexers and sorted(absorbed) == sorted(layout.attention)
    without = dataclasses.replace(layout, indexers={})
    for context in (4096, 1 << 17):
        got = activation_reserve(model.config, layout, model.dtype, 512, 8, context, absorbed)
        plain = activation_reserve(model.config, without, model.dtype, 512, 8, context, absorbed)
        assert got == plain + INDEXER_BYTES + GATHER_BYTES


def test_a_recurrent_only_model_takes_one_block_per_sequence_and_its_state_slots(monkeypatch):
    """No layer of Mamba-2 keeps K/V: a block holds no memory, so each sequence takes one block of ``max_model_len``
    tokens (twice as many blocks as sequences: the scheduler's watermark holds none back) and the state slots alone
    bound the engine — every slot running at once; they must fit in the CPU's default pool, and on CUDA in
    kv_cache_fraction of the device and in its free memory beside the activations; kv_cache_memory does not apply."""
    from tests.helpers import mixed_prompts, reference, run
    from tests.models import family_model

    model = family_model("mamba2")
    budget = _plan(model)
    assert (budget.num_blocks, budget.block_size, budget.bytes) == (16, 256, 0)
    assert budget.state_bytes == 9 * model_layout(model).state_bytes() > 0  # (and the scratch slot)
    assert "no layer keeps K/V" in budget.reason and str(budget).startswith("no KV cache and ")
    with pytest.raises(ValueError, match="kv_cache_memory does not apply to a model none of whose layers keeps K/V"):
        _plan(model, kv_cache_memory=GIB)
    prompts, budgets = mixed_prompts(3, seed=2)[0], [4, 4, 4]
    expected = reference(model, prompts, budgets)
    engine = Engine(hfaccel.accelerate(model, attention="torch"), max_num_seqs=2)
    assert engine.runner.pool.block_size == engine.max_model_len
    for prompt, params in zip(prompts, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 3):
        engine.add_request(prompt, params)
    engine.step()
    assert (engine.stats()["running"], engine.stats()["waiting"]) == (2, 1)  # both slots in use, the third waits
    engine = Engine(model, max_num_seqs=2)
    assert [out.outputs[0].token_ids for out in run(engine, prompts, budgets)] == expected
    monkeypatch.setattr(kv_budget, "CPU_POOL_BYTES", budget.state_bytes - 1)
    with pytest.raises(RuntimeError, match=r"sequences \(0.00 GiB\) does not fit in 1 GiB on the CPU"):
        _plan(model)
    monkeypatch.setattr(kv_budget, "CPU_POOL_BYTES", GIB)
    monkeypatch.setattr(kv_budget, "model_device", lambda model: torch.device("cuda"))
    reserve = activation_reserve(model.config, model_layout(model), model.dtype, 512, 8)
    fits = reserve + budget.state_bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fits, 80 * GIB))
    assert _plan(model).state_bytes == budget.state_bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fits - 1, 80 * GIB))
    with pytest.raises(RuntimeError, match="the recurrent state of max_num_seqs=8 sequences"):
        _plan(model)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fits, budget.state_bytes * 4))
    with pytest.raises(RuntimeError, match="kv_cache_fraction=0.2"):
        _plan(model, kv_cache_fraction=0.2)


def test_a_hybrid_models_state_that_leaves_no_kv_block_is_refused(monkeypatch):
    """Qwen3-Next's state slots come first: where they leave no KV block in the default pool (the CPU's 1 GiB, or
    kv_cache_fraction of the device), the engine is refused with the reason rather than given one block that would
    hold no prompt; where one block is left, the pool has what is left."""
    from tests.models import family_model

    model = family_model("qwen3_next")
    state_bytes = _plan(model).state_bytes
    assert state_bytes > 0
    monkeypatch.setattr(kv_budget, "CPU_POOL_BYTES", state_bytes - 1)
    with pytest.raises(RuntimeError, match=r"leaves no room for a KV block in 1 GiB on the CPU \(the default pool\)"):
        _plan(model)
    block_bytes = _plan(model, num_blocks=1).block_bytes
    monkeypatch.setattr(kv_budget, "CPU_POOL_BYTES", state_bytes + 3 * block_bytes)
    assert _plan(model).num_blocks == 3
    monkeypatch.setattr(kv_budget, "model_device", lambda model: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 2 * state_bytes))
    with pytest.raises(RuntimeError, match=r"leaves no room for a KV block in kv_cache_fraction=0.5 of"):
        _plan(model)
