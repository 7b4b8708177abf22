"""Multi-head latent attention read in the latent space (``hfaccel.kv.latent``) over a runner's life: a pool that
grows keeps it, the modules' pass-through stays while any runner reads the model so (an engine outlives a second
``accelerate``) and goes with the last one, and a model copied or saved meanwhile is itself."""

import copy
import io

import torch

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.kv.latent import absorbed_layers
from hfaccel.kv.layout import model_layout
from tests.helpers import reference
from tests.models import family_model, padded_batch

GREEDY = dict(do_sample=False, pad_token_id=0)
PROMPTS = [list(range(5, 5 + n)) for n in (9, 14, 6)]


def _instance_expands(model) -> int:
    return sum("expand_kv" in vars(module) for module in model.modules())


def test_a_grown_pool_keeps_the_latent_space():
    """A later ``generate()`` that needs more blocks replaces the session's pool: its cache reads the latent layers
    as the first did (no expansion of every held token) — the eager tokens."""
    model = family_model("deepseek_v3")
    small, large = padded_batch((11, 7, 4)), padded_batch((250,) * 5)
    expected = [model.generate(**batch, max_new_tokens=8, **GREEDY) for batch in (small, large)]
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**small, max_new_tokens=8, **GREEDY), expected[0])
    runner = model.hfaccel.session.runner
    blocks = runner.pool.num_blocks
    model.hfaccel.attention_paths.counts.clear()
    assert torch.equal(model.generate(**large, max_new_tokens=8, **GREEDY), expected[1])
    runner = model.hfaccel.session.runner
    assert runner.pool.num_blocks > blocks and sorted(runner.cache.absorbed) == [0, 1]
    assert model.hfaccel.attention_paths.counts.keys() == {"hfaccel paged latent (torch)"}


def test_an_engine_reads_its_model_after_a_second_accelerate():
    """``accelerate`` again (which restores first) while an engine serves the model: the engine's layers keep their
    pass-through and its tokens; closing the last runner takes it away."""
    model = family_model("deepseek_v3")
    expected = reference(model, PROMPTS, [5, 5, 5])
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    hfaccel.accelerate(model, attention="torch")
    engine = Engine(model, max_num_seqs=4, num_blocks=40, block_size=4)
    assert [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)] == expected
    hfaccel.accelerate(model, attention="torch")
    assert [out.outputs[0].token_ids for out in engine.generate(PROMPTS, params)] == expected
    hfaccel.restore(model)
    assert _instance_expands(model) == 2  # the engine still reads the model in the latent space
    engine.close()
    assert _instance_expands(model) == 0


def test_a_model_copied_or_saved_while_an_engine_serves_it_is_itself():
    """A deep copy's pass-through expands with the copy's own weights; ``torch.save`` of the model works."""
    model = family_model("deepseek_v3")
    engine = Engine(model, max_num_seqs=4, num_blocks=40, block_size=4)
    assert _instance_expands(model) == 2
    torch.save(model, io.BytesIO())
    twin = copy.deepcopy(model)
    attention = twin.model.layers[0].self_attn
    with torch.no_grad():
        attention.kv_b_proj.weight.normal_()
    latent, rope = torch.randn(1, 1, 3, twin.config.kv_lora_rank), torch.randn(1, 1, 3, twin.config.qk_rope_head_dim)
    latent, rope = latent.to(twin.device), rope.to(twin.device)
    keys = attention.expand_kv(latent, rope)[0]
    assert torch.equal(keys, type(attention).expand_kv(attention, latent, rope)[0])
    engine.close()


def test_a_windowed_latent_layer_keeps_the_expansion():
    """The latent-space attention has no window: a latent layer with one is not read so."""
    from dataclasses import replace

    model = family_model("deepseek_v3")
    layout = model_layout(model)
    assert sorted(absorbed_layers(model, layout)) == [0, 1]
    windowed = replace(layout, attention={i: replace(kv, window=4) for i, kv in layout.attention.items()})
    assert absorbed_layers(model, windowed) == {}


def test_engines_over_shared_modules_keep_their_pass_through():
    """Two models over one backbone (the same attention modules): closing one's engine leaves the other's layers
    theirs; the last close, and ``restore``, take the pass-through and the dequantized matrices away."""
    from hfaccel.kv import latent
    from tests.helpers import run

    model = family_model("deepseek_v3")
    hfaccel.quantize(model, "fp8")
    expected = reference(model, PROMPTS, [5, 5, 5])
    twin = family_model("deepseek_v3")
    twin.model, twin.lm_head = model.model, model.lm_head
    first = Engine(model, max_num_seqs=4, num_blocks=40, block_size=4)
    second = Engine(twin, max_num_seqs=4, num_blocks=40, block_size=4)
    second.close()
    assert [out.outputs[0].token_ids for out in run(first, PROMPTS, [5, 5, 5])] == expected
    first.close()
    hfaccel.restore(model)
    assert _instance_expands(model) == 0
    assert not any(module in latent._DEQUANTIZED for module in model.modules())


def test_a_quantized_expansion_changed_in_place_is_read_again():
    """A quantized ``kv_b_proj`` whose scales change in place (``load_state_dict``): the next runner reads its new
    matrix, not the one dequantized before."""
    model = family_model("deepseek_v3")
    hfaccel.quantize(model, "fp8")
    projection = model.model.layers[0].self_attn.kv_b_proj
    first = Engine(model, max_num_seqs=4, num_blocks=40, block_size=4)
    state = projection.state_dict()
    state = {name: tensor * 1.05 if name.endswith("scale") else tensor for name, tensor in state.items()}
    projection.load_state_dict(state)
    second = Engine(model, max_num_seqs=4, num_blocks=40, block_size=4)
    identity = torch.eye(model.config.kv_lora_rank, device=model.device)
    assert torch.equal(second.runner.absorbed[0].weight, projection(identity).t())
    assert not torch.equal(first.runner.absorbed[0].weight, second.runner.absorbed[0].weight)
    first.close()
    second.close()
