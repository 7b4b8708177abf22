"""This year's families in the Engine: each prompt's own greedy tokens under preemption, chunked prefill and both
schedulings (MLA's latents in the pool, DeepSeek Sparse Attention's indexer keys beside them, prefix caching on);
hybrid models' state slots allocated, forked, preempted and freed with the sequences' blocks."""

import pytest

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from tests.helpers import greedy, mixed_prompts, reference, run
from tests.models import HYBRID_FAMILIES, family_model


ENGINE_FAMILIES = ["qwen3_next", "falcon_h1", "lfm2", "jamba", "mamba2", "minimax", "zaya", "gpt_oss", "gemma4"]
ENGINE_FAMILIES += ["llama4"]
ENGINE_FAMILIES += ["deepseek_v3", "deepseek_v32", "dots3_note"]  # MLA; sparse attention, a windowed MLA layer


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("name", [*ENGINE_FAMILIES, "kimi_linear"])
def test_exactness_with_preemption_and_chunked_prefill(name, async_scheduling):
    model = family_model(name)
    prompts, budgets = mixed_prompts(12, seed=1)
    expected = reference(model, prompts, budgets)
    engine = Engine(
        hfaccel.accelerate(model, attention="torch"),
        max_num_seqs=6,
        num_blocks=14,
        block_size=4,
        max_num_batched_tokens=11,
        async_scheduling=async_scheduling,
    )
    outputs = run(engine, prompts, budgets)
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.outputs[0].token_ids == want, f"{name}: prompt {i} differs"
    assert sum(out.metrics.num_preemptions for out in outputs) > 0, "the tiny pool should have forced preemption"
    stats = engine.stats()
    assert stats["blocks_used"] == 0
    if name in HYBRID_FAMILIES:
        assert stats["prefix_caching"].startswith("off (the model's layers keep recurrent state")
        assert stats["state_slots_free"] == stats["state_slots"] == 6 and stats["state_bytes"] > 0
        assert sum(out.metrics.num_cached_tokens for out in outputs) == 0
    else:
        assert "state_slots" not in stats and stats["prefix_caching"] == "on"


@pytest.mark.parametrize("name", ["qwen3_next", "jamba"])
def test_n_completions_fork_the_state(name):
    """n > 1: the completions forked from the first one's prompt each start from a copy of its state."""
    model = family_model(name)
    prompt = list(range(5, 19))
    want = reference(model, [prompt], [7])[0]
    engine = Engine(hfaccel.accelerate(model, attention="torch"), max_num_seqs=4, num_blocks=40, block_size=4)
    out = engine.generate(prompt, greedy(7, n=3))[0]
    assert [o.token_ids for o in out.outputs] == [want] * 3
    assert engine.stats()["state_slots_free"] == 4


def test_abort_frees_the_state_slot():
    engine = Engine(
        hfaccel.accelerate(family_model("falcon_h1"), attention="torch"), max_num_seqs=3, num_blocks=32, block_size=4
    )
    ids = [engine.add_request(list(range(3, 20)), greedy(30)) for _ in range(3)]
    engine.step()
    assert engine.stats()["state_slots_free"] == 0
    assert engine.abort(ids[1])
    assert engine.stats()["state_slots_free"] == 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["state_slots_free"] == 3


def test_seeded_sampling_is_the_same_alone_and_batched():
    """Seeded requests on a hybrid model draw the same tokens alone and beside others (each row its own state)."""
    model = hfaccel.accelerate(family_model("qwen3_next"), attention="torch")
    prompts, _ = mixed_prompts(5, seed=3)
    params = [SamplingParams(max_tokens=6, temperature=0.8, seed=10 + i, ignore_eos=True) for i in range(5)]
    settings = dict(max_num_seqs=8, num_blocks=60, block_size=4)
    together = Engine(model, **settings).generate(prompts, params)
    alone = [Engine(model, **settings).generate([p], [q])[0] for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def _long_memory_model(model_type: str):
    """A tiny model of ``model_type`` whose Mamba scans barely decay (as a trained model's slow channels), so that a
    state read wrong shows in its tokens."""
    import torch
    import transformers

    from tests.hf.tiny_configs import tiny_config
    from tests.models import FAMILIES

    overrides = FAMILIES[model_type][1] if model_type in FAMILIES else {}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, vocab_size=96, **overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("A_log"):
                parameter.fill_(-6.0)
            if name.endswith(("dt_proj.bias", "dt_bias")):
                parameter.fill_(0.5)
    return model


@pytest.mark.parametrize("model_type, restarting", [("mamba", [0, 1]), ("jamba", [0, 2]), ("mamba2", [])])
def test_mixers_that_restart_a_chunk_continue_it_token_by_token(model_type, restarting):
    """transformers' Mamba-1 mixers (Mamba, Jamba) read their state one token at a time only: a chunk of several
    starts its scan afresh. hfaccel finds such layers (``ModelLayout.restarts_chunks``) and runs their continuing
    chunks token by token: a prompt computed in two chunks gives the logits of the prompt computed whole. Mamba-2's
    mixers continue a chunk from their state and run as they are."""
    import torch

    from hfaccel.attention import hfaccel_attention
    from hfaccel.kv import KVPool
    from hfaccel.kv.layout import model_layout
    from hfaccel.runner import ModelRunner

    model = _long_memory_model(model_type)
    assert sorted(model_layout(model).restarts_chunks) == restarting
    tokens = torch.arange(3, 30)
    pool = KVPool.for_model(model, num_blocks=8, block_size=16, max_num_seqs=2)
    runner = ModelRunner(model, pool)
    with hfaccel_attention(model, "torch"), torch.inference_mode():
        whole = runner.forward([0], tokens, [27])
        runner.forward([1], tokens[:6], [6])
        chunked = runner.forward([1], tokens[6:], [21])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_a_restarting_mixer_class_is_found_past_a_first_layer_that_barely_reads_its_state():
    """The probe decides a mixer class on the first of its layers whose state moves the logits at all, by how much
    less it moves them over two new tokens than over one: Mamba's layer 0 reading its scan's state a thousandth as
    strongly (its C rows scaled down), or the probe's usual token having a zero embedding (an untrained padding
    row), still finds both layers restarting."""
    import torch

    from hfaccel.kv.layout import model_layout

    model = _long_memory_model("mamba")
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():
        mixer.x_proj.weight[-mixer.ssm_state_size :] *= 1e-3
        model.get_input_embeddings().weight[1].zero_()
    assert sorted(model_layout(model).restarts_chunks) == [0, 1]


def test_a_cache_the_probe_cannot_continue_marks_every_state_layer_restarting_with_a_warning(monkeypatch, caplog):
    """Where the probe's cache cannot be continued (the model's code raises on it), every state layer is taken as
    restarting, with a warning: its continuing chunks run token by token, exact whatever its mixers do."""
    import logging

    import hfaccel.kv.continuation as continuation
    from hfaccel.kv.layout import model_layout
    from tests.models import family_model

    def fail(*args, **kwargs):
        raise ValueError("this cache cannot be continued")

    monkeypatch.setattr(continuation._Continuation, "logits", fail)
    model = family_model("qwen3_next")
    with caplog.at_level(logging.WARNING, logger="hfaccel"):
        layout = model_layout(model)
    assert layout.restarts_chunks == frozenset(layout.states) != frozenset()
    assert any("continuations of a cached state fail (this cache cannot" in message for message in caplog.messages)


def test_prompts_of_a_model_whose_mixers_restart_a_chunk_are_computed_whole():
    """The engine computes each prompt of such a model (Mamba) in one chunk, one longer than the token budget alone
    in its step, as transformers computes it: each prompt's own tokens."""
    model = _long_memory_model("mamba")
    prompts = [list(range(3, 30)), list(range(10, 23)), [5, 6, 7, 8]]
    expected = reference(model, prompts, [6, 6, 6])
    engine = Engine(hfaccel.accelerate(model, attention="torch"), max_num_seqs=2, max_num_batched_tokens=6)
    assert engine.scheduler.whole_prompts
    engine.add_request(prompts[0], greedy(6))
    assert [chunk.length for chunk in engine.scheduler.schedule().chunks] == [27]
    engine = Engine(model, max_num_seqs=2, max_num_batched_tokens=6)
    assert [out.outputs[0].token_ids for out in run(engine, prompts, [6, 6, 6])] == expected
