"""This year's families in ``generate``: hybrid models (their recurrent state in the pool's state slots), attention
sinks (gpt-oss), per-layer head sizes and shared K/V (Gemma 4), multi-head latent attention (DeepSeek-V3,
Kimi-Linear: latents in the pool, the K/V the module expands read by hfaccel's attention) — transformers' tokens
from hfaccel's loop, on the Triton kernels (interpreted on the CPU) and compiled; speculative decoding refused where
state cannot roll back."""

import copy

import pytest
import torch

import hfaccel
from hfaccel.runner.support import model_support
from tests.devices import DEVICE
from tests.models import (
    FAMILIES,
    HYBRID_FAMILIES,
    LATENT_FAMILIES,
    RECURRENT_ONLY_FAMILIES,
    SPARSE_FAMILIES,
    family_model,
    padded_batch,
    require_family,
)

GREEDY = dict(do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_triton_kernels_give_transformers_tokens(name):
    """A left-padded batch through hfaccel's loop and Triton kernels (fp32): transformers' own tokens."""
    model = family_model(name)
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=8, **GREEDY)
    hfaccel.accelerate(model, attention="triton", compile=False)
    assert torch.equal(model.generate(**batch, max_new_tokens=8, **GREEDY), expected)
    assert str(model.hfaccel.decode) == "hfaccel"
    # hfaccel's kernels served the attention calls (a recurrent-only model makes none)
    assert bool(model.hfaccel.attention_paths.counts) == (name not in RECURRENT_ONLY_FAMILIES)
    paths = set(model.hfaccel.attention_paths.counts)
    if name in SPARSE_FAMILIES:  # each query's 4 chosen keys, fewer than it sees: exact torch attention over them
        assert "torch sparse" in paths
    assert all(path.startswith("hfaccel") for path in paths - {"torch sparse"})
    if name in LATENT_FAMILIES:  # read in the latent space (the decode steps and the batch's prefill)
        assert "hfaccel paged latent (triton)" in model.hfaccel.attention_paths.counts
    layout = model_support(model).layout
    assert layout.hybrid == (name in HYBRID_FAMILIES)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_transformers_loop_keeps_working(name):
    """A call hfaccel's loop leaves to transformers' (``return_dict_in_generate``) on hfaccel's attention: its tokens,
    over transformers' own cache where a PagedCache cannot hold the layers (state, per-layer heads, shared K/V, a
    cache class of the model's own)."""
    model = family_model(name)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    expected = model.generate(**batch, **kwargs).sequences
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, **kwargs).sequences, expected)
    assert model.hfaccel.decode.path == "transformers"


# families whose own code (transformers') specialises a compiled step to one sequence: batch 1 runs padded to 2
SPECIALISE_BATCH_ONE = ("llama4", "qwen3_5_moe", "gemma4", "zaya")


@pytest.mark.parametrize(
    "name", ["qwen3_next", "falcon_h1", "lfm2", "gpt_oss", "minimax", "jamba", "mamba2", *SPECIALISE_BATCH_ONE]
)
def test_compiled_decode_step_keeps_one_graph(name):
    """The decode step compiled (torch.compile, fullgraph), the recurrent layers' state written in place inside it:
    the eager tokens, and one graph for every batch size — batch 1 on it too, at size 1 or, where the model's code
    specialises size 1, padded to 2 with the reason in the steps' status."""
    from torch._dynamo.utils import counters

    model = family_model(name)
    batches = [padded_batch(lengths) for lengths in ((11, 7, 4), (6,), (5, 9))]
    expected = [model.generate(**batch, max_new_tokens=5, **GREEDY) for batch in batches]
    hfaccel.accelerate(model, attention="torch", compile=True)
    before = counters["stats"]["unique_graphs"]
    for batch, want in zip(batches, expected):
        assert torch.equal(model.generate(**batch, max_new_tokens=5, **GREEDY), want)
    graphs = model.hfaccel.session.runner.graphs
    assert graphs.compiled, model.hfaccel.session.steps()
    assert counters["stats"]["unique_graphs"] - before == 1
    assert ("batch 1 runs at 2" in graphs.status()) == (name in SPECIALISE_BATCH_ONE), graphs.status()


def _long_context_deepseek():
    """A DeepSeek-V3 model whose context is 65536 tokens, and a left-padded batch."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    config = tiny_config("deepseek_v3", vocab_size=96, max_position_embeddings=65536)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE), padded_batch((11, 7, 4))


def test_latent_attention_decodes_compiled_in_the_latent_space():
    """MLA read in the latent space (``hfaccel.kv.latent``): each token's two latents one row of the pool, the decode
    step compiled as any model's, one graph for every batch size — the eager tokens."""
    from torch._dynamo.utils import counters

    model, batch = _long_context_deepseek()
    batches = [batch, padded_batch((6,)), padded_batch((5, 9))]
    expected = [model.generate(**each, max_new_tokens=6, **GREEDY) for each in batches]
    hfaccel.accelerate(model, attention="torch", compile=True)
    before = counters["stats"]["unique_graphs"]
    for each, want in zip(batches, expected):
        assert torch.equal(model.generate(**each, max_new_tokens=6, **GREEDY), want)
    runner = model.hfaccel.session.runner
    assert runner.graphs.compiled and runner.graphs.eager_reason is None, runner.graphs.status()
    assert counters["stats"]["unique_graphs"] - before == 1
    assert sorted(runner.absorbed) == [0, 1] and not runner.expands_latents
    config = model.config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert runner.pool.group_shapes == [(1, latent // 2)] and runner.pool.latent_groups == {0}
    # the prefills: a batch's in the latent space, one prompt's alone over the K/V its new latents expand to
    assert model.hfaccel.attention_paths.counts.keys() == {"hfaccel paged latent (torch)", "hfaccel paged (torch)"}


def test_latent_attention_over_an_fp8_pool_runs_at_its_batchs_context():
    """An fp8 pool keeps a scale per key and value half of a latent row, so MLA expands every held token at each
    step: its decode steps run at the power of two holding the batch's longest sequence, not the model's whole
    context (65536 tokens), so uncompiled and uncaptured even where compiling is asked for, with the reason in the
    steps' status."""
    from hfaccel.runner.step_function import static_step

    model, batch = _long_context_deepseek()
    hfaccel.accelerate(model, attention="torch", compile=True, kv_cache_dtype=torch.float8_e4m3fn)
    first = model.generate(**batch, max_new_tokens=6, **GREEDY)
    runner = model.hfaccel.session.runner
    contexts, run_model = [], runner.run_model
    runner.run_model = lambda ids, step, *rest: contexts.append(step.max_seq_len) or run_model(ids, step, *rest)
    assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), first)
    graphs = runner.graphs
    assert runner.absorbed == {} and runner.expands_latents
    assert not graphs.compiled and "multi-head latent attention" in graphs.status()
    assert graphs._step_fn is static_step  # nothing compiled behind the status
    assert graphs.max_model_len >= 65536 and contexts and max(contexts) <= 512  # the 11 + 6 tokens' bucket


def test_sparse_attention_decodes_at_the_batchs_context():
    """DeepSeek Sparse Attention: the indexer scores every key its sequences hold, each step, so the decode steps run at
    the batch's context, uncompiled, with the reason in their status — the eager tokens; where the indexer keeps every
    key (``index_topk`` past the context) the latents are read by the paged kernel, as DeepSeek-V3's."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    model = family_model("deepseek_v32")
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=6, **GREEDY)
    hfaccel.accelerate(model, attention="torch", compile=True)
    assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), expected)
    graphs = model.hfaccel.session.runner.graphs
    assert not graphs.compiled and "sparse attention's indexer" in graphs.status()
    assert model.hfaccel.attention_paths.counts.keys() == {"torch sparse"}
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    assert all("forward" in vars(indexer) for indexer in indexers)  # run per group of sequences (hfaccel.kv.indexer)
    hfaccel.restore(model)
    assert not any("forward" in vars(indexer) for indexer in indexers)
    assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), expected)

    config = tiny_config("deepseek_v32", vocab_size=96, index_topk=64, index_n_heads=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)
    expected = model.generate(**batch, max_new_tokens=6, **GREEDY)
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), expected)
    assert "torch sparse" not in model.hfaccel.attention_paths.counts
    assert "hfaccel paged latent (torch)" in model.hfaccel.attention_paths.counts


def test_state_slots_grow_with_the_batch():
    """A larger batch than the pool's state slots hold replaces the pool (the decode steps kept): still exact."""
    model = family_model("falcon_h1")
    batches = [padded_batch(lengths) for lengths in ((5,), (9, 4, 7), tuple(range(3, 12)))]
    expected = [model.generate(**batch, max_new_tokens=6, **GREEDY) for batch in batches]
    hfaccel.accelerate(model, attention="torch")
    slots = []
    for batch, want in zip(batches, expected):
        assert torch.equal(model.generate(**batch, max_new_tokens=6, **GREEDY), want)
        runner = model.hfaccel.session.runner
        slots.append(runner.pool.states.num_slots)
        assert runner.pool.manager.num_free_state_slots == slots[-1]  # every row's slot given back
    assert slots == [1, 4, 16]


def test_speculative_decoding_refuses_recurrent_state():
    """Rejected drafts cannot be taken back out of a recurrent state: hfaccel's speculative decoding refuses such a
    model with the reason, and generate(assistant_model=...) leaves the call to transformers."""
    model = family_model("qwen3_next")
    draft = copy.deepcopy(model)
    hfaccel.accelerate(model, attention="torch")
    with pytest.raises(ValueError, match="target model: its layers keep recurrent state"):
        hfaccel.speculative_generate(model, draft, **padded_batch(), max_new_tokens=4)
    with pytest.warns(UserWarning, match="recurrent state"):
        try:
            model.generate(**padded_batch(), assistant_model=draft, max_new_tokens=4, **GREEDY)
        except Exception as error:  # transformers' own assisted generation may not run such a model either
            assert "hfaccel" not in str(type(error).__module__)


@pytest.mark.parametrize(
    "model_type, reason", [("qwen4_exp", "indexer over full keys"), ("deepseek_v4", "store_compression_weights")]
)
def test_a_model_that_cannot_be_served_keeps_transformers_path(model_type, reason):
    """A family whose cache hfaccel's pool cannot hold (Qwen4-Exp's sparse attention keeps indexer keys beside full
    K/V; DeepSeek-V4's cache layers keep its compressors' state) is declined before the first call, with the reason,
    its tokens unchanged."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    if model_type not in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = tiny_config(model_type, vocab_size=96)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(DEVICE)
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=4, **GREEDY)
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, max_new_tokens=4, **GREEDY), expected)
    assert not model.hfaccel.active
    assert reason in model.hfaccel.fallback_reason


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_latent_attention_serves_speculative_decoding_and_fp8_pools(name):
    """MLA (DeepSeek-V3; V3.2 with its sparse attention): the pool holds each layer's latents (and indexer keys) and
    hfaccel's attention reads them — speculative decoding's verify steps (several tokens per sequence) and an fp8
    pool (stored in fp8, read back dequantized) too."""
    import transformers

    from tests.hf.tiny_configs import tiny_config

    require_family(name)

    def deepseek(seed: int):
        torch.manual_seed(seed)
        config = tiny_config(FAMILIES[name][0], vocab_size=96, **FAMILIES[name][1])
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    model, draft = deepseek(0).to(DEVICE), deepseek(1).to(DEVICE)
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=9, **GREEDY)
    fp8 = hfaccel.accelerate(copy.deepcopy(model), attention="torch", kv_cache_dtype=torch.float8_e4m3fn)
    hfaccel.accelerate(model, attention="torch")
    hfaccel.accelerate(draft, attention="torch")
    assert torch.equal(hfaccel.speculative_generate(model, draft, **batch, max_new_tokens=9), expected)
    path = "torch sparse" if name in SPARSE_FAMILIES else "hfaccel paged latent (torch)"
    assert model.hfaccel.attention_paths.counts.keys() == {path}
    quantized = fp8.generate(**batch, max_new_tokens=9, **GREEDY)
    assert quantized.shape == expected.shape and str(fp8.hfaccel.decode) == "hfaccel"
    assert (quantized[:, -9:] == expected[:, -9:]).float().mean() > 0.5  # fp8 latents: close, not exact
    # scales from each layer's first prefill: of the rows as the pool stores them (a latent row's two halves)
    calibrated = hfaccel.accelerate(
        deepseek(0).to(DEVICE), attention="torch", kv_cache_dtype=torch.float8_e4m3fn, kv_scales="prefill"
    )
    again = calibrated.generate(**batch, max_new_tokens=9, **GREEDY)
    assert again.shape == expected.shape and str(calibrated.hfaccel.decode) == "hfaccel"
    pool = calibrated.hfaccel.session.runner.pool
    assert not any(pool.calibrating(layer) for layer in pool.layout.attention)
    scales = torch.cat([scale.flatten() for scale in pool.scales])
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all()) and not bool((scales == 1).all())


@pytest.mark.parametrize("method", ["rtn", "fp8"])
def test_latent_attention_reads_a_quantized_expansion_in_the_latent_space(method):
    """MLA whose ``kv_b_proj`` is quantized (hfaccel's int4 or fp8): the matrix it multiplies by, dequantized once,
    serves the latent-space attention — the quantized model's own tokens."""
    model = family_model("deepseek_v3")
    hfaccel.quantize(model, method, group_size=32)
    layer = type(model.model.layers[0].self_attn.kv_b_proj).__name__
    assert layer == ("Int4Linear" if method == "rtn" else "Fp8Linear")
    batch = padded_batch()
    expected = model.generate(**batch, max_new_tokens=8, **GREEDY)
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, max_new_tokens=8, **GREEDY), expected)
    absorbed = model.hfaccel.session.runner.absorbed
    assert sorted(absorbed) == [0, 1]
    assert model.hfaccel.attention_paths.counts.keys() == {"hfaccel paged latent (torch)"}
    engine = hfaccel.Engine(model, max_num_seqs=2, num_blocks=16)  # the dequantized matrices are shared
    assert all(engine.runner.absorbed[layer].weight is heads.weight for layer, heads in absorbed.items())
    engine.close()


def test_llama4_scales_each_packed_query_at_its_own_position():
    """Llama 4's no-RoPE layers scale a query by the attention temperature of its position (here from position 23 on,
    by 1 + 10 log 2): hfaccel's packed forwards scale each at its position in its sequence, so ``generate`` and the
    Engine give transformers' tokens past it. A forward is exact up to ``floor_scale - 1`` tokens (transformers
    scales by the index in the forward), and transformers scales a left-padded row at its padded position: a prefill
    of more tokens, or padded rows growing past that, are left to transformers' loop with the reason. The Engine
    caps its batch and token budget there, not its context."""
    import transformers

    from hfaccel.engine import Engine
    from tests.hf.tiny_configs import tiny_config

    config = tiny_config("llama4_text", vocab_size=96, **FAMILIES["llama4"][1], floor_scale=24, attn_scale=10.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(DEVICE)
    batch = padded_batch()  # 22 prompt tokens, the longest 11: 32 new tokens take it to position 42
    prompts = [row[mask.bool()][None] for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    alone = [model.generate(prompt, max_new_tokens=32, **GREEDY)[0, prompt.shape[1] :].tolist() for prompt in prompts]
    same_length = torch.cat([prompts[0], prompts[0].flip(1)])  # no padding
    expected, padded = (model.generate(**b, max_new_tokens=32, **GREEDY) for b in ({"input_ids": same_length}, batch))
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(same_length, max_new_tokens=32, **GREEDY), expected)
    assert str(model.hfaccel.decode) == "hfaccel"
    assert torch.equal(model.generate(**batch, max_new_tokens=32, **GREEDY), padded)
    assert model.hfaccel.decode.path == "transformers" and "left-padded rows" in model.hfaccel.decode.reason
    wide = padded_batch((11, 9, 7, 5))  # 32 prompt tokens in one prefill
    model.generate(**wide, max_new_tokens=2, **GREEDY)
    assert "past the 23 tokens" in model.hfaccel.decode.reason
    engine = Engine(model, max_num_seqs=64, max_num_batched_tokens=4096, num_blocks=64, block_size=4)
    assert engine.max_model_len == config.max_position_embeddings
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (23, 23)
    params = hfaccel.SamplingParams(max_tokens=32, temperature=0.0)  # stopping at EOS, as transformers does
    outputs = engine.generate([prompt[0].tolist() for prompt in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == alone
