"""LoRA adapters in the Engine: each adapter's greedy tokens equal PEFT's own ``generate`` with that adapter active
(Llama and Qwen2, ranks 8 and 16, every projection), in batches that mix adapters and the base model — eagerly and
through the static decode step, synchronously and asynchronously scheduled; the prefix cache never shares K/V
across adapters; more adapters than slots wait their turn; preemption and n > 1 keep their adapter; adapters come
and go; bad adapters and names are clear errors after which the engine serves on; ``close`` gives the model back.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hfaccel
from hfaccel.engine import AsyncEngine, Engine, SamplingParams
from hfaccel.kv import BlockManager, model_layout
from hfaccel.lora import LoRAContext, LoRALinear
from hfaccel.quant import Int4Linear, quantize_rtn
from tests.lora.adapters import NEW_TOKENS, PROMPTS, greedy_tokens, rewrite_tensors, save_adapter
from tests.models import tiny_model

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


class Setup:
    """A tiny model on hfaccel's torch kernels, adapters saved by PEFT, and PEFT's tokens for each (None: base)."""

    def __init__(self, arch: str, folder, ranks: dict[str, dict]):
        base = tiny_model(arch)
        self.paths, self.expected = {}, {None: greedy_tokens(base)}
        for seed, (name, config) in enumerate(ranks.items()):
            peft_model = save_adapter(base, folder / name, seed=seed + 1, **config)
            self.paths[name] = str(folder / name)
            self.expected[name] = greedy_tokens(peft_model)
        self.model = hfaccel.accelerate(base, attention="torch")
        self.engines: list[Engine] = []

    def engine(self, adapters=None, **kwargs) -> Engine:
        kwargs = {"max_lora_rank": 16, "num_blocks": 128, "block_size": 4, "max_num_seqs": 16, **kwargs}
        engine = Engine(self.model, lora_adapters=self.paths if adapters is None else adapters, **kwargs)
        self.engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines.clear()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    setup = Setup(
        "llama",
        tmp_path_factory.mktemp("llama-loras"),
        {
            "r8": {"r": 8},
            "r16": {"r": 16},
            # rsLoRA, per-module ranks and alphas: PEFT's scaling rules
            "mixed": {"r": 8, "use_rslora": True, "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"down_proj": 3}},
        },
    )
    for name in ("r8", "r16", "mixed"):
        assert setup.expected[name] != setup.expected[None], f"adapter {name} should change the tokens"
    yield setup
    setup.close()


@pytest.fixture
def engines(llama):
    yield llama
    llama.close()


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def mixed_batch(setup: Setup, names) -> tuple[list[list[int]], list, list[list[int]]]:
    """Every prompt under every adapter name, interleaved: prompts, names, PEFT's tokens."""
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(PROMPTS):
        for name in names:
            prompts.append(prompt), loras.append(name), expected.append(setup.expected[name][i])
    return prompts, loras, expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_adapter_equals_peft_in_one_batch(arch, tmp_path):
    setup = Setup(arch, tmp_path, {"r8": {"r": 8}, "r16": {"r": 16}})
    try:
        prompts, loras, expected = mixed_batch(setup, [None, "r8", "r16"])
        assert tokens(setup.engine().generate(prompts, GREEDY, lora=loras)) == expected
    finally:
        setup.close()


MODES = {
    "eager": {"cuda_graphs": False},
    "static-step-async": {"cuda_graphs": True, "async_scheduling": True},
}  # DecodeGraphs' step, uncaptured


@pytest.mark.parametrize("mode", sorted(MODES))
def test_three_adapters_and_the_base_mixed_equal_each_alone(engines, mode):
    engine = engines.engine(**MODES[mode])
    names = [None, "r8", "r16", "mixed"]
    prompts, loras, expected = mixed_batch(engines, names)
    assert tokens(engine.generate(prompts, GREEDY, lora=loras)) == expected
    for name in names:
        assert tokens(engine.generate(PROMPTS, GREEDY, lora=name)) == engines.expected[name]
    # seeded sampling: a row's tokens do not depend on its neighbours' adapters either
    sampled = [SamplingParams(max_tokens=6, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(prompts))]
    together = tokens(engine.generate(prompts, sampled, lora=loras))
    for name in names:
        rows = [i for i, lora in enumerate(loras) if lora == name]
        alone = tokens(engine.generate([prompts[i] for i in rows], [sampled[i] for i in rows], lora=name))
        assert alone == [together[i] for i in rows], name
    assert engine.stats()["blocks_used"] == 0 and engine.stats()["lora_slots_loaded"] == 3


def test_static_step_serves_a_mix_of_adapters_in_every_row(engines, monkeypatch):
    engine = engines.engine(cuda_graphs=True)
    graphs = engine.runner.graphs
    variants = []
    original = graphs._replay
    monkeypatch.setattr(
        graphs,
        "_replay",
        lambda size, advance, lora=False, draw=False: variants.append(lora) or original(size, advance, lora, draw),
    )
    prompts, loras, expected = mixed_batch(engines, ["r16", None, "mixed"])
    assert tokens(engine.generate(prompts, GREEDY, lora=loras)) == expected
    assert True in variants
    variants.clear()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == engines.expected[None]
    assert variants and True not in variants  # a batch of the base model only runs no LoRA op


def test_prefix_cache_is_keyed_by_adapter(engines):
    engine = engines.engine(cuda_graphs=False)
    prompt, i = PROMPTS[2], 2  # 21 tokens: five full blocks of 4
    runs = [("r8", 0), ("r16", 0), (None, 0), ("r8", 20), ("r16", 20), (None, 20)]
    for name, cached in runs:  # one at a time: each finds the blocks the runs before it registered
        out = engine.generate([prompt], GREEDY, lora=name)[0]
        assert out.outputs[0].token_ids == engines.expected[name][i], name
        assert out.metrics.num_cached_tokens == cached, name


def test_the_block_manager_shares_blocks_under_one_salt_only():
    manager = BlockManager(16, 4)
    prompt = list(range(3, 12))  # 9 tokens: two full blocks can hit
    assert manager.add_sequence("a", prompt, salt=("lora", 1)) == 0
    assert manager.add_sequence("b", prompt, salt=("lora", 2)) == 0
    assert manager.add_sequence("base", prompt) == 0
    assert manager.add_sequence("a-again", prompt, salt=("lora", 1)) == 8
    assert manager.add_sequence("base-again", prompt) == 8
    manager.fork("a", "a-child")
    manager.free("a")
    manager.append("a-child", 4, [1, 2, 3, 4])  # its later blocks chain to the salted ones
    assert manager.add_sequence("a-longer", prompt + [1, 2, 3, 4, 5], salt=("lora", 1)) == 12
    assert manager.block_table("a-longer")[:3] == manager.block_table("a-child")[:3]
    manager.check_invariants()


def test_more_adapters_than_slots_wait_their_turn(engines, monkeypatch):
    engine = engines.engine(max_loras=2, cuda_graphs=False)
    distinct = []
    forward = engine.runner.forward

    def spy(*args, lora_slots=None, **kwargs):
        distinct.append(len({slot for slot in lora_slots or [] if slot >= 0}))
        return forward(*args, lora_slots=lora_slots, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", spy)
    prompts, loras, expected = mixed_batch(engines, ["r8", "r16", None, "mixed"])
    assert tokens(engine.generate(prompts, GREEDY, lora=loras)) == expected
    assert max(distinct) == 2  # never more than max_loras in one step, and the two slots were shared
    assert engine.stats()["lora_slots_loaded"] == 2


def test_preemption_and_n_keep_their_adapter(engines):
    engine = engines.engine(num_blocks=14, max_num_seqs=8, cuda_graphs=False)  # 56 slots: preemption
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, n=2)
    prompts, loras, expected = mixed_batch(engines, ["r8", "mixed"])
    outputs = engine.generate(prompts, params, lora=loras)
    for out, want in zip(outputs, expected):
        assert [completion.token_ids for completion in out.outputs] == [want, want]
    assert sum(out.metrics.num_preemptions for out in outputs) > 0


def test_add_and_remove_adapters(engines):
    engine = engines.engine(adapters={}, cuda_graphs=False)
    assert engine.list_loras() == []
    engine.add_lora("a", engines.paths["r8"])
    with pytest.raises(ValueError, match="already loaded"):
        engine.add_lora("a", engines.paths["r16"])
    request = engine.add_request(PROMPTS[0], GREEDY, lora="a")
    with pytest.raises(ValueError, match="in use by 1 unfinished request"):
        engine.remove_lora("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[request].seqs[0].output.token_ids == engines.expected["r8"][0]
    engine.release(request)
    engine.remove_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        engine.generate(PROMPTS, GREEDY, lora="a")
    engine.add_lora("a", engines.paths["r16"])  # the name again, another adapter: nothing of the old one is reused
    assert tokens(engine.generate(PROMPTS, GREEDY, lora="a")) == engines.expected["r16"]
    assert engine.list_loras() == ["a"]


# ------------------------------------------------------------------------------------------------ bad inputs
def _bad_adapter(kind: str, setup: Setup, folder):
    """(path, what the error says) of an adapter the engine must refuse."""
    r8 = Path(setup.paths["r8"])
    base = tiny_model("llama")
    if kind == "rank-above-max":
        save_adapter(base, folder, r=32, seed=5)
        return folder, "rank 32, above the engine's max_lora_rank=16"
    if kind == "target-the-base-lacks":
        rename = lambda t: {k.replace("layers.1.", "layers.7."): v for k, v in t.items()}  # noqa: E731
        return rewrite_tensors(r8, folder, rename), "has no module of that name"
    if kind == "wrong-shape":

        def narrow(tensors):
            key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
            return {**tensors, key: tensors[key][:, :48].contiguous()}

        return rewrite_tensors(r8, folder, narrow), "do not fit the base layer"
    if kind == "not-a-peft-directory":
        folder.mkdir()
        base.save_pretrained(folder)  # a model, not an adapter
        return folder, "is not a PEFT adapter directory"
    if kind == "missing-path":
        return folder / "nothing", "is not a PEFT adapter directory .*: it is missing"
    if kind == "dora":
        save_adapter(base, folder, r=8, seed=5, use_dora=True)
        return folder, "DoRA"
    if kind == "bias":
        save_adapter(base, folder, r=8, seed=5, bias="lora_only")
        return folder, "bias='none'"
    if kind == "modules-to-save":
        save_adapter(base, folder, r=8, seed=5, modules_to_save=["lm_head"])
        return folder, "modules_to_save"
    if kind == "lm-head":  # PEFT saves lm_head's own weight beside (save_embedding_layers): that alone is refused too
        save_adapter(base, folder / "saved", r=8, seed=5, target_modules=["q_proj", "lm_head"])
        lora_only = lambda t: {k: v for k, v in t.items() if "base_layer" not in k}  # noqa: E731
        return rewrite_tensors(folder / "saved", folder / "lora-only", lora_only), "output embedding"
    raise AssertionError(kind)


BAD = [
    "rank-above-max",
    "target-the-base-lacks",
    "wrong-shape",
    "not-a-peft-directory",
    "missing-path",
    "dora",
    "bias",
    "modules-to-save",
    "lm-head",
]


def test_bad_adapters_are_refused_and_the_engine_serves_on(engines, tmp_path):
    engine = engines.engine(cuda_graphs=False)
    for kind in BAD:
        path, message = _bad_adapter(kind, engines, tmp_path / kind)
        with pytest.raises(ValueError, match=message):
            engine.add_lora(kind, path)
        assert kind not in engine.list_loras()
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope' is loaded"):
        engine.generate(PROMPTS, GREEDY, lora=["r8", "nope", None, "r16"])
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'"):
        engine.add_request(PROMPTS[0], GREEDY, lora="nope")
    assert engine.requests == {} and not engine.has_unfinished_requests()  # nothing admitted
    prompts, loras, expected = mixed_batch(engines, ["r16", None, "r8"])
    assert tokens(engine.generate(prompts, GREEDY, lora=loras)) == expected


def test_a_bad_adapter_at_start_leaves_the_model_unchanged(llama, tmp_path):
    path, message = _bad_adapter("dora", llama, tmp_path / "dora")
    before = dict(llama.model.named_modules())
    with pytest.raises(ValueError, match=message):
        Engine(llama.model, lora_adapters={"ok": llama.paths["r8"], "bad": path}, max_lora_rank=16)
    assert dict(llama.model.named_modules()) == before


def test_close_gives_the_model_back_and_lora_needs_an_lora_engine(llama):
    layers = {name: m for name, m in llama.model.named_modules() if isinstance(m, nn.Linear)}
    keys = list(llama.model.state_dict())
    engine = llama.engine(cuda_graphs=False)
    assert isinstance(llama.model.model.layers[0].mlp.down_proj, LoRALinear)
    engine.close()
    assert {name: m for name, m in llama.model.named_modules() if isinstance(m, nn.Linear)} == layers
    assert list(llama.model.state_dict()) == keys
    with pytest.raises(RuntimeError, match="closed"):
        engine.add_request(PROMPTS[0], GREEDY)
    plain = Engine(llama.model, cuda_graphs=False)
    with pytest.raises(ValueError, match="serves no LoRA adapters"):
        plain.generate(PROMPTS, GREEDY, lora="r8")
    with pytest.raises(ValueError, match="made without LoRA"):
        plain.add_lora("r8", llama.paths["r8"])
    assert tokens(plain.generate(PROMPTS, GREEDY)) == llama.expected[None]


def test_a_second_engine_on_the_model_takes_its_layers_over(engines):
    first = engines.engine(cuda_graphs=False)
    second = engines.engine(cuda_graphs=False)
    with pytest.raises(RuntimeError, match="took over its LoRA layers"):
        first.generate(PROMPTS, GREEDY, lora="r8")
    assert tokens(second.generate(PROMPTS, GREEDY, lora="r8")) == engines.expected["r8"]
    assert tokens(first.generate(PROMPTS, GREEDY)) == engines.expected[None]


def test_an_engine_that_fails_to_start_gives_the_layers_back(engines):
    first = engines.engine(cuda_graphs=False)
    with pytest.raises(ValueError):
        Engine(engines.model, lora_adapters=engines.paths, max_lora_rank=16, num_blocks=0)  # no KV blocks
    assert tokens(first.generate(PROMPTS, GREEDY, lora="r8")) == engines.expected["r8"]  # still its layers


def test_an_adapter_without_a_slot_is_not_starved_by_later_ones(engines):
    """One slot; r8 holds it while r16 waits: r8 requests arriving after r16 wait behind it, base ones go on."""
    engine = engines.engine(max_loras=1, cuda_graphs=False)
    long = SamplingParams(max_tokens=NEW_TOKENS * 2, temperature=0, ignore_eos=True)
    engine.add_request(PROMPTS[0], long, lora="r8", request_id="r8-first")
    engine.step()  # r8 takes the slot
    engine.add_request(PROMPTS[0], GREEDY, lora="r16", request_id="r16")
    engine.add_request(PROMPTS[1], GREEDY, lora="r8", request_id="r8-later")
    engine.add_request(PROMPTS[1], GREEDY, request_id="base")
    engine.step()
    running = {seq.request.request_id for seq in engine.scheduler.running}
    assert running == {"r8-first", "base"}  # r8-later waits behind r16
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests["r16"].seqs[0].output.token_ids == engines.expected["r16"][0]
    assert engine.requests["r8-later"].seqs[0].output.token_ids == engines.expected["r8"][1]


def test_lora_under_tensor_parallelism_is_refused(llama, monkeypatch):
    import hfaccel.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "tensor_parallel", lambda model: object())
    with pytest.raises(ValueError, match="not supported under tensor parallelism"):
        Engine(llama.model, lora_adapters=llama.paths)


def test_async_engine_serves_adds_and_removes_adapters(engines):
    engine = AsyncEngine(engines.engine(adapters={"r8": engines.paths["r8"]}, cuda_graphs=False))

    async def scenario():
        await engine.add_lora("r16", engines.paths["r16"])
        outs = await asyncio.gather(
            *(engine.generate(p, GREEDY, lora=name) for p in PROMPTS for name in ("r16", None, "r8"))
        )
        with pytest.raises(ValueError, match="no LoRA adapter named 'x'"):
            await engine.generate(PROMPTS[0], GREEDY, lora="x")
        await engine.remove_lora("r16")
        with pytest.raises(ValueError, match="no LoRA adapter named 'r16'"):
            await engine.generate(PROMPTS[0], GREEDY, lora="r16")
        stream = engine.stream(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True), "busy", lora="r8")
        await anext(stream)
        engine.abort("busy")
        await engine.remove_lora("r8")  # the abort queued before it is applied first
        return outs

    try:
        outs = asyncio.run(scenario())
    finally:
        engine.shutdown()
    want = [engines.expected[name][i] for i in range(len(PROMPTS)) for name in ("r16", None, "r8")]
    assert tokens(outs) == want


def test_lora_linear_over_an_int4_layer():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=True)
    int4 = Int4Linear.from_weight(quantize_rtn(linear.weight.data, 32), linear.bias.data, dtype=torch.float32)
    context = LoRAContext("torch")
    layer = LoRALinear(int4, context, max_loras=3, max_rank=8)
    a, b = torch.randn(4, 64), torch.randn(32, 4)
    layer.load_slot(2, (a, b))
    x = torch.randn(1, 5, 64)
    base = int4(x)
    assert torch.equal(layer(x), base)  # no index: the base layer alone
    context.index, context.slots = torch.tensor([2, -1, 2, 0, -1]), [0, 2]
    out = layer(x)
    expected = base.clone()
    expected[0, [0, 2]] += x[0, [0, 2]] @ a.T @ b.T
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    layer.load_slot(2, None)
    assert torch.equal(layer(x), base)


@pytest.mark.parametrize(
    "name, refused, reason",
    [
        ("deepseek_v3", "kv_b_proj", "expands a multi-head latent attention layer's cached latents"),
        ("deepseek_v32", "wk", "a layer of a sparse-attention indexer"),
    ],
)
def test_latent_attention_adapters_equal_peft_and_what_it_cannot_serve_is_refused(tmp_path, name, refused, reason):
    """DeepSeek-V3 (multi-head latent attention) and V3.2 (with sparse attention): an adapter on the query, latent
    and output projections gives PEFT's tokens in a batch mixed with the base model; one on ``kv_b_proj`` — which
    expands every held token's latent, in batches whose sequences take different adapters — or on V3.2's indexer's
    layers (which hfaccel runs per group of sequences, apart from the packed rows a LoRA index follows) is refused
    with the reason, the model left as it was."""
    from tests.models import family_model

    base = family_model(name).cpu()
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]
    peft = save_adapter(base, tmp_path / "ok", r=4, seed=1, target_modules=targets)
    prompts = [[p % 90 + 3 for p in prompt] for prompt in PROMPTS[:2]]
    expected = greedy_tokens(peft, prompts) + greedy_tokens(base, prompts)
    save_adapter(base, tmp_path / "refused", r=4, seed=2, target_modules=[refused])
    before = dict(base.named_modules())
    with pytest.raises(ValueError, match=reason):
        Engine(hfaccel.accelerate(base, attention="torch"), lora_adapters={"refused": tmp_path / "refused"})
    assert dict(base.named_modules()) == before
    engine = Engine(base, lora_adapters={"ok": tmp_path / "ok"}, num_blocks=64, cuda_graphs=False)
    out = engine.generate(prompts * 2, GREEDY, lora=["ok", "ok", None, None])
    assert tokens(out) == expected


MAMBA_TYPES = ("falcon_h1", "mamba2")  # PEFT's models whose mixers' out_proj it refuses to adapt


@pytest.mark.parametrize(
    "name, mode",
    [
        ("qwen3_next", "static-step-async"),
        ("falcon_h1", "eager"),
        ("jamba", "static-step-async"),
        ("lfm2", "eager"),
        ("minimax", "static-step-async"),
        ("mamba2", "eager"),
    ],
)
def test_adapters_on_a_hybrid_models_mixers_equal_peft(tmp_path, name, mode):
    """Adapters on the Linear layers of hybrid models' mixers and attention — the mixers run per group of sequences
    (``hfaccel.kv.state``: a prefill's groups by prompt length, a static step's rows and its scratch row), each row
    taking its own sequence's adapter: two adapters and the base model mixed in one batch give each one's PEFT
    tokens, in eager or static decode steps, the mixers' projections wrapped (Jamba's ``dt_proj``, whose weight its
    mixer reads rather than calling the layer, without the adapters, as under PEFT)."""
    from tests.models import family_model

    base = family_model(name).cpu()
    mixers = tuple(f"{mixer}." for mixer in model_layout(base).mixers.values())
    in_mixers = [n for n, m in base.named_modules() if type(m) is nn.Linear and n.startswith(mixers)]
    if name in MAMBA_TYPES:  # PEFT refuses their out_proj
        in_mixers = [n for n in in_mixers if not n.endswith(".out_proj")]
    assert in_mixers, f"{name}'s mixers have no Linear layer"
    targets = "|".join([*map(re.escape, in_mixers), r".*\.(q|k|v|o)_proj"])  # and the attention's
    prompts = [[p % 90 + 3 for p in prompt] for prompt in PROMPTS[:3]]  # 7, 4 and 21 tokens
    expected = {None: greedy_tokens(base, prompts)}
    for seed, adapter in enumerate(("a", "b"), 1):
        peft = save_adapter(base, tmp_path / adapter, r=4, seed=seed, target_modules=targets)
        expected[adapter] = greedy_tokens(peft, prompts)
    engine = Engine(
        hfaccel.accelerate(base, attention="torch"),
        lora_adapters={adapter: tmp_path / adapter for adapter in ("a", "b")},
        num_blocks=64,
        **MODES[mode],
    )
    try:
        wrapped = [n for n, m in base.named_modules() if isinstance(m, LoRALinear) and n.startswith(mixers)]
        assert wrapped == in_mixers
        names = [None, "a", "b"]
        batch = [(prompt, adapter, expected[adapter][i]) for i, prompt in enumerate(prompts) for adapter in names]
        out = engine.generate([p for p, _, _ in batch], GREEDY, lora=[a for _, a, _ in batch])
        assert tokens(out) == [want for _, _, want in batch]
        assert engine.stats()["blocks_used"] == 0
    finally:
        engine.close()
