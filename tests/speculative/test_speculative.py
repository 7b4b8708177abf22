"""Speculative decoding is lossless: greedy tokens are the target's own; sampled tokens have its distribution.

Most cases run hfaccel's torch reference kernels (``torch_kernels``) to keep the suite fast on the CPU; the
Triton kernels (interpreted) run in ``test_greedy_through_triton_kernels`` and the ``generate`` route, and
the packed-sequence kernels themselves are compared in tests/engine and tests/kernels.
"""

import copy

import pytest
import torch
import transformers

import hfaccel
from hfaccel.engine import Engine, SamplingParams
from hfaccel.kv import KVPool
from hfaccel.speculative import decoding as speculative
from hfaccel.speculative import lookup_continuation, speculative_generate, verification
from tests.devices import DEVICE
from tests.models import ARCHITECTURES, padded_batch, tiny_model
from tests.sampling.reference import chi_square_p_value, transformers_probabilities
from tests.speculative.host_reads import counting, host_side

NEW_TOKENS = 24
GREEDY = {"do_sample": False, "pad_token_id": 0, "eos_token_id": []}


def perturbed_copy(model, scale: float = 0.1, seed: int = 7):
    """A draft close to the target: it agrees on most tokens, not all (so rollback is exercised)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=gen).to(param) * scale * param.abs().mean())
    return draft


def torch_kernels(*models):
    """Run speculative decoding on hfaccel's pure-torch kernels (the model is accelerated for the test)."""
    for model in models:
        if model is not None and not hasattr(model, "hfaccel"):
            hfaccel.accelerate(model, attention="torch")
    return models[0]


def _batch():
    return padded_batch(lengths=(11, 7, 4, 9))  # 4 prompts of different lengths, left padding


def _target_greedy(model, batch, new_tokens=NEW_TOKENS, eos=None):
    return model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=eos)


def _drafts(model, kind: str):
    return {
        "perturbed": perturbed_copy(model),
        "self": model,
        "unrelated": tiny_model(_arch_of(model), seed=5),
        "ngram": None,
    }[kind]


def _arch_of(model) -> str:
    return next(a for a, (_, cls, _) in ARCHITECTURES.items() if type(model).__name__ == cls)


def test_verification_and_drafting_run_the_runners_static_steps(monkeypatch):
    """The target verifies every row's last token and drafts in one static step of k + 1 tokens per row (rows
    with fewer drafts padded), the draft model drafts in one-token static steps and catches up on what the target
    accepted (one or two tokens per row) in a static step too: CUDA graphs on a GPU. Only the prompts run eagerly
    (one packed forward per model)."""
    from hfaccel.runner import DecodeGraphs

    served, real = [], DecodeGraphs.run
    eager, real_packed_step = [], KVPool.packed_step

    def run(self, seq_ids, input_ids, starts, num_new=None):
        served.append((self.tokens_per_seq, self.last_only, list(num_new)))
        return real(self, seq_ids, input_ids, starts, num_new)

    def packed_step(self, seq_ids, starts, num_new):
        eager.append((id(self), list(num_new)))
        return real_packed_step(self, seq_ids, starts, num_new)

    model = tiny_model("qwen2")
    batch = _batch()
    expected = _target_greedy(model, batch, eos=[])
    draft = perturbed_copy(model)
    torch_kernels(model, draft)  # before the counting: accelerate's trial forwards are not speculative decoding's
    monkeypatch.setattr(DecodeGraphs, "run", run)
    monkeypatch.setattr(KVPool, "packed_step", packed_step)
    got = speculative_generate(model, draft, **batch, max_new_tokens=NEW_TOKENS, num_draft_tokens=3, **GREEDY)
    assert torch.equal(got, expected)
    verify = [counts for q, last, counts in served if q == 4]
    assert verify and any(len(set(c)) > 1 for c in verify)  # rows with fewer drafts than others, padded
    assert any(q == 1 for q, _, _ in served)
    catch_up = [counts for q, last, counts in served if q == 2 and last]
    assert catch_up and any(2 in counts for counts in catch_up)  # a row that took every draft: two tokens
    prompts = [length - 1 for length in batch["attention_mask"].sum(1).tolist()]
    assert sorted(counts for _, counts in eager) == sorted([prompts, [n + 1 for n in prompts]])  # the prefills


def test_assisted_generate_keeps_its_runners_between_calls():
    """generate(assistant_model=...) on an accelerated model builds its runners (pools, compiled and captured
    steps) once and reuses them; a larger call (more rows, longer) keeps their steps and swaps larger pools in,
    the old pools' memory given back at once."""
    model, draft = tiny_model("llama"), perturbed_copy(tiny_model("llama"))
    batch = _batch()
    expected = _target_greedy(model, batch, eos=[])
    torch_kernels(model, draft)
    runners = []
    for _ in range(2):
        assert torch.equal(
            model.generate(**batch, assistant_model=draft, max_new_tokens=NEW_TOKENS, **GREEDY), expected
        )
        runners.append((model.hfaccel.session.speculative.target, model.hfaccel.session.speculative.draft))
    assert runners[0][0] is runners[1][0] and runners[0][1] is runners[1][1]
    target, draft_runner = runners[0]
    pools, steps = (target.pool, draft_runner.pool), (target.graphs, draft_runner.graphs, draft_runner.catch_up)
    larger = padded_batch(lengths=(11, 7, 4, 9, 3, 5))
    expected = _target_greedy(model, larger, new_tokens=3 * NEW_TOKENS, eos=[])
    assert torch.equal(
        model.generate(**larger, assistant_model=draft, max_new_tokens=3 * NEW_TOKENS, **GREEDY), expected
    )
    speculative = model.hfaccel.session.speculative
    assert (speculative.target, speculative.draft) == (target, draft_runner)
    assert (target.graphs, draft_runner.graphs, draft_runner.catch_up) == steps  # built once
    assert target.pool is not pools[0] and draft_runner.pool is not pools[1]  # grown
    assert not pools[0].allocated and not pools[1].allocated  # the old pools' memory went back at once


@pytest.mark.slow
def test_compiled_steps_give_the_targets_tokens():
    model = tiny_model("llama")
    batch = _batch()
    expected = _target_greedy(model, batch, eos=[])
    draft = perturbed_copy(model)
    torch_kernels(model, draft)
    got = speculative_generate(model, draft, **batch, max_new_tokens=NEW_TOKENS, compile=True, **GREEDY)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("kind", ["perturbed", "self", "unrelated", "ngram"])
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_equals_target_generate(arch, kind):
    model = tiny_model(arch)
    batch = _batch()
    expected = _target_greedy(model, batch, eos=[])
    draft = _drafts(model, kind)
    torch_kernels(model, draft)
    got, stats = speculative_generate(
        model,
        draft,
        **batch,
        max_new_tokens=NEW_TOKENS,
        draft="ngram" if draft is None else "model",
        return_stats=True,
        **GREEDY,
    )
    assert torch.equal(got, expected), f"{arch}/{kind}: {stats}\n{got}\n!= target\n{expected}"
    if kind == "self":
        assert stats.acceptance_rate == 1.0, stats
    if kind == "perturbed" and arch not in ("gemma2",):  # gemma2's tiny softcapped model is too easy to draft
        assert 0.0 < stats.acceptance_rate < 1.0, f"the draft should be partly rejected: {stats}"
    assert stats.proposed > 0 or kind == "ngram"


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_through_triton_kernels(arch):
    model = tiny_model(arch)
    batch = _batch()
    expected = _target_greedy(model, batch, new_tokens=10, eos=[])
    got = speculative_generate(model, perturbed_copy(model), **batch, max_new_tokens=10, **GREEDY)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("k", [1, 8])
def test_num_draft_tokens_1_and_8(k):
    model = tiny_model("llama")
    batch = _batch()
    draft = perturbed_copy(model)
    torch_kernels(model, draft)
    got = speculative_generate(model, draft, **batch, num_draft_tokens=k, max_new_tokens=NEW_TOKENS, **GREEDY)
    assert torch.equal(got, _target_greedy(model, batch, eos=[]))


@pytest.mark.parametrize("new_tokens", [1, 3, 5])
def test_max_new_tokens_inside_an_accepted_run(new_tokens):
    """Draft = target accepts all 8 drafts: the budget ends inside the accepted run."""
    model = tiny_model("qwen2")
    batch = _batch()
    torch_kernels(model)
    got, stats = speculative_generate(
        model, model, **batch, num_draft_tokens=8, max_new_tokens=new_tokens, return_stats=True, **GREEDY
    )
    assert torch.equal(got, _target_greedy(model, batch, new_tokens, eos=[]))
    assert stats.target_forwards == 1


@pytest.mark.parametrize("kind", ["perturbed", "ngram"])
def test_learned_positions_to_the_last_position_of_the_context(kind):
    """GPT-2 embeds positions from a table of ``n_positions`` rows: the verification steps' padding tokens (past
    a row's drafts) must not take positions beyond the context, where the last steps would index past it."""
    config = transformers.GPT2Config(
        n_positions=36, n_embd=64, n_layer=2, n_head=4, vocab_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval().to(DEVICE)
    batch = _batch()  # the longest prompt (11) + 25 new tokens fills all 36 positions
    expected = _target_greedy(model, batch, new_tokens=25, eos=[])
    draft = perturbed_copy(model) if kind == "perturbed" else None
    torch_kernels(model, draft)
    got = speculative_generate(
        model,
        draft,
        **batch,
        draft="model" if draft is not None else "ngram",
        num_draft_tokens=4,
        max_new_tokens=25,
        **GREEDY,
    )
    assert torch.equal(got, expected)


def test_rows_hit_eos_at_different_steps():
    model = tiny_model("llama")
    batch = _batch()
    free_run = _target_greedy(model, batch, eos=[])[:, batch["input_ids"].shape[1] :]
    # an EOS that row 0 emits late and another row emits early (or never): rows finish at different steps
    eos = next(t for t in free_run[0, 8:].tolist() if t not in free_run[0, :8].tolist())
    expected = _target_greedy(model, batch, eos=eos)
    draft = perturbed_copy(model)
    torch_kernels(model, draft)
    got = speculative_generate(
        model, draft, **batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=eos
    )
    assert torch.equal(got, expected)
    lengths = [(row == eos).nonzero()[0].item() if (row == eos).any() else None for row in got]
    assert len(set(lengths)) > 1, lengths


def test_draft_in_another_dtype_and_device():
    model = tiny_model("mistral")
    batch = _batch()
    draft = perturbed_copy(model).to(torch.bfloat16).to("cpu")  # on a GPU run: the draft stays on the CPU
    torch_kernels(model, draft)
    got = speculative_generate(model, draft, **batch, max_new_tokens=NEW_TOKENS, **GREEDY)
    assert torch.equal(got, _target_greedy(model, batch, eos=[]))


def test_generate_with_assistant_model_and_prompt_lookup():
    model = tiny_model("phi3")
    batch = _batch()
    expected = _target_greedy(model, batch, eos=[])
    draft = torch_kernels(perturbed_copy(model))
    hfaccel.accelerate(model, attention="torch")
    assert torch.equal(model.generate(**batch, assistant_model=draft, max_new_tokens=NEW_TOKENS, **GREEDY), expected)
    assert torch.equal(
        model.generate(**batch, prompt_lookup_num_tokens=3, max_new_tokens=NEW_TOKENS, **GREEDY), expected
    )


def test_generate_with_an_assistant_passes_the_seed_on():
    """generate(assistant_model=..., seed=...) draws speculative_generate's seeded numbers: the same tokens as it
    with that seed, whatever the global generator holds."""
    model = tiny_model("llama")
    batch = _batch()
    draft = torch_kernels(perturbed_copy(model))
    hfaccel.accelerate(model, attention="torch")
    sampled = dict(max_new_tokens=10, do_sample=True, temperature=1.5, pad_token_id=0, eos_token_id=[])
    expected = speculative_generate(model, draft, **batch, seed=11, **sampled)
    torch.manual_seed(123)
    assert torch.equal(model.generate(**batch, assistant_model=draft, seed=11, **sampled), expected)


def test_generate_with_an_unsupported_option_uses_transformers_with_a_warning():
    model = tiny_model("llama")
    batch = {k: v[:1] for k, v in _batch().items()}  # transformers' assisted decoding: batch size 1
    kwargs = {"max_new_tokens": 8, "repetition_penalty": 1.3, **GREEDY}
    expected = model.generate(**batch, **kwargs)
    draft = perturbed_copy(model)
    hfaccel.accelerate(model)
    with pytest.warns(UserWarning, match="repetition_penalty"):
        got = model.generate(**batch, assistant_model=draft, **kwargs)
    assert torch.equal(got, expected)


def test_seeded_sampling_is_reproducible_and_stops_at_budget():
    model = tiny_model("qwen3")
    batch = _batch()
    kwargs = {
        "max_new_tokens": 16,
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "seed": 3,
        "pad_token_id": 0,
        "eos_token_id": [],
    }
    draft = perturbed_copy(model)
    torch_kernels(model, draft)
    state = torch.get_rng_state()
    first = speculative_generate(model, draft, **batch, **kwargs)
    assert torch.equal(torch.get_rng_state(), state)  # keyed numbers: no generator is drawn from
    assert torch.equal(first, speculative_generate(model, draft, **batch, **kwargs))
    assert first.shape == (4, batch["input_ids"].shape[1] + 16)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_sampling_with_the_target_as_draft_gives_the_engines_tokens(arch):
    """Draft = target: every draft is accepted, and each token is the one the Engine's sampler draws with the
    same key — row ``i`` of the call is completion ``i`` of an Engine request with the same seed (flat warped
    distributions, where a draw that depended on rounding would show)."""
    model = torch_kernels(tiny_model(arch))
    batch = _batch()
    sampling = {"temperature": 1.3, "top_k": 40, "top_p": 0.9}
    got, stats = speculative_generate(
        model,
        model,
        **batch,
        max_new_tokens=NEW_TOKENS,
        num_draft_tokens=4,
        do_sample=True,
        seed=2026,
        return_stats=True,
        pad_token_id=0,
        eos_token_id=[],
        **sampling,
    )
    assert stats.acceptance_rate == 1.0, stats
    engine = Engine(model, max_num_seqs=4, num_blocks=64, block_size=4)
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
    expected = [
        engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, n=i + 1, seed=2026, ignore_eos=True, **sampling))[
            0
        ]
        .outputs[i]
        .token_ids
        for i, prompt in enumerate(prompts)
    ]
    assert got[:, batch["input_ids"].shape[1] :].tolist() == expected
    assert len({tuple(tokens) for tokens in expected}) == 4


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_a_verification_step_reads_the_device_once(monkeypatch, draft, do_sample):
    """Batch 4, 4 drafts a row: a step drafts and verifies from what the host knows (host values go up by
    non-blocking copies), then reads its outcome once — what would make the host wait for the GPU on CUDA."""
    monkeypatch.setattr(KVPool, "packed_step", host_side(KVPool.packed_step))  # host tensors by design
    steps = []
    monkeypatch.setattr(speculative, "_step", counting(speculative._step, steps))
    model = tiny_model("llama")
    drafter = perturbed_copy(model) if draft == "model" else None
    torch_kernels(model, drafter)
    _, stats = speculative_generate(
        model,
        drafter,
        **_batch(),
        draft=draft,
        num_draft_tokens=4,
        max_new_tokens=12,
        do_sample=do_sample,
        seed=0,
        return_stats=True,
        pad_token_id=0,
        eos_token_id=[],
    )
    assert len(steps) == stats.target_forwards > 1 and stats.proposed > 0
    assert [waits.reads for waits in steps] == [["Tensor.tolist"]] * len(steps)
    assert [waits.uploads for waits in steps] == [[]] * len(steps)


# ------------------------------------------------------------------------------ distribution exactness
VOCAB = 6
SAMPLES = 4000
SAMPLING = {"temperature": 0.9, "top_k": 5, "top_p": 0.95}


def _tiny_vocab_model(seed: int):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(20)  # distributions that depend on the context
    return hfaccel.accelerate(model.to(DEVICE), attention="torch")


def _exact_two_token_distribution(model, prompt: torch.Tensor) -> torch.Tensor:
    """P(t1, t2) of the target's own sampling with SAMPLING, computed exactly: ``[V, V]``."""
    with torch.no_grad():
        first = transformers_probabilities(model(prompt).logits[0, -1], **SAMPLING)
        second = [
            transformers_probabilities(
                model(torch.cat([prompt, prompt.new_tensor([[t]])], 1)).logits[0, -1], **SAMPLING
            )
            for t in range(VOCAB)
        ]
    return first[:, None] * torch.stack(second)


def _sampled_pairs(target, draft) -> torch.Tensor:
    prompt = torch.tensor([[1, 2, 3, 4]], device=DEVICE)
    out, stats = speculative_generate(
        target,
        draft,
        prompt.repeat(SAMPLES, 1),
        max_new_tokens=3,
        num_draft_tokens=2,
        do_sample=True,
        seed=11,
        eos_token_id=[],
        return_stats=True,
        **SAMPLING,
    )
    assert 0.3 < stats.acceptance_rate < 0.95, stats  # both accepted and rejected drafts are in the sample
    counts = torch.zeros(VOCAB, VOCAB)
    for a, b in out[:, 4:6].tolist():
        counts[a, b] += 1
    return counts


@pytest.fixture(scope="module")
def sampling_setup():
    target, draft = _tiny_vocab_model(0), _tiny_vocab_model(1)
    exact = _exact_two_token_distribution(target, torch.tensor([[1, 2, 3, 4]], device=DEVICE))
    return target, draft, exact


def test_sampled_distribution_is_the_targets(sampling_setup):
    target, draft, exact = sampling_setup
    p_value = chi_square_p_value(_sampled_pairs(target, draft), exact)
    assert p_value > 0.001, f"speculative samples do not follow the target's distribution (p = {p_value:.2e})"


def test_a_biased_acceptance_rule_fails_the_same_test(sampling_setup, monkeypatch):
    """The test has power: resampling from p (not from max(p - q, 0)) after a rejection is caught."""
    target, draft, exact = sampling_setup
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    p_value = chi_square_p_value(_sampled_pairs(target, draft), exact)
    assert p_value < 1e-6, f"a biased rule went unnoticed (p = {p_value:.2e})"


# ----------------------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_clearly():
    model = tiny_model("llama")
    batch = _batch()
    other_vocab = (
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=97,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
            )
        )
        .eval()
        .to(DEVICE)
    )
    cases = [
        ({"draft_model": other_vocab}, "vocabulary \\(97 tokens\\) differs from the target's \\(96\\)"),
        ({"draft_model": None}, "needs a draft_model"),
        ({"draft_model": model, "num_draft_tokens": 0}, "num_draft_tokens must be an int >= 1"),
        ({"draft_model": model, "draft": "medusa"}, "draft must be 'model' or 'ngram'"),
        ({"draft_model": model, "max_new_tokens": 0}, "max_new_tokens must be an int >= 1"),
        ({"draft_model": model, "do_sample": True, "temperature": 0.0}, "temperature must be a number > 0"),
        ({"draft_model": model, "stop_strings": ["\n"]}, "stop_strings needs the tokenizer"),
        ({"draft_model": model, "input_ids": batch["input_ids"] + 100}, "token ids in \\[0, 96\\)"),
        ({"draft_model": model, "attention_mask": batch["attention_mask"] * 0}, "row 0 of input_ids has no tokens"),
        ({"draft_model": model, "input_ids": batch["input_ids"][0]}, "must be a \\[batch, length\\] tensor"),
    ]
    for overrides, message in cases:
        kwargs = {**batch, "max_new_tokens": 4, **overrides}
        with pytest.raises(ValueError, match=message):
            speculative_generate(model, **kwargs)
    assert model.config._attn_implementation == "sdpa"  # nothing left patched


def test_prompt_lookup_proposes_the_latest_continuation():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 1, 2, 3]
    assert lookup_continuation(tokens, 3, 2) == [8, 7]  # latest earlier "1 2 3"
    assert lookup_continuation(tokens, 3, 10) == [8, 7, 5, 1, 2, 3]
    assert lookup_continuation([4, 5, 6], 3, 4) == []
    assert lookup_continuation([4, 5, 4], 1, 4) == [5, 4]
    assert lookup_continuation(tokens, 3, 0) == []
