"""ModelRunner: packed forwards of several sequences (each with its own length) equal the model's own forward.

fp32 logits, atol 1e-4: magnitudes ~10, only the accumulation order differs from transformers' attention.
"""

import pytest
import torch

from hfaccel import CacheFullError
from hfaccel.attention import hfaccel_attention
from hfaccel.kv import KVPool
from hfaccel.runner import ModelRunner
from tests.models import ARCHITECTURES, BASELINE_ATTENTION, tiny_model

PROMPTS = [[5, 9, 3, 7, 11, 2, 8, 40, 41, 42, 43], [4, 4, 6], [17], list(range(3, 23))]  # 20 > sliding window 8


def _reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens], device=model.device)).logits[0]  # [S, V]


def _flat(chunks: list[list[int]], device) -> torch.Tensor:
    return torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.long, device=device)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_packed_chunks_match_full_forward(arch):
    """Prefill chunks of different sizes, then a mixed step (decode + prefill), per sequence == model(seq)."""
    model = tiny_model(arch)
    expected = [_reference_logits(model, p) for p in PROMPTS]
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=64, block_size=4))
        first = [p[:3] for p in PROMPTS]  # the third prompt is a single token: whole in this step
        logits1 = runner.forward([0, 1, 2, 3], _flat(first, model.device), [len(c) for c in first], logits_for="all")
        rest = {0: PROMPTS[0][3:], 3: PROMPTS[3][3:]}
        logits2 = runner.forward(
            list(rest), _flat(list(rest.values()), model.device), [len(c) for c in rest.values()], logits_for="all"
        )
    assert model.config._attn_implementation == BASELINE_ATTENTION.get(arch, "sdpa")  # put back
    offsets = [0, 3, 6, 7]
    for seq, length in enumerate(len(c) for c in first):
        torch.testing.assert_close(
            logits1[offsets[seq] : offsets[seq] + length], expected[seq][:length], atol=1e-4, rtol=0
        )
    split = len(rest[0])
    torch.testing.assert_close(logits2[:split], expected[0][3:], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits2[split:], expected[3][3:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_crop_rolls_one_sequence_back(arch):
    """Rejected tokens of one sequence are cropped and overwritten; the other sequence is untouched."""
    model = tiny_model(arch)
    a, b = PROMPTS[0], PROMPTS[3]
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=32, block_size=4))
        runner.forward([0, 1], _flat([a, b], model.device), [len(a), len(b)])
        runner.forward([0, 1], _flat([[50, 51, 52], [60]], model.device), [3, 1])  # 3 guesses for seq 0
        runner.crop(0, len(a) + 1)  # keep the first guess only
        assert runner.seq_len(0) == len(a) + 1 and runner.seq_len(1) == len(b) + 1
        logits = runner.forward([0, 1], _flat([[70], [61]], model.device), [1, 1])
    torch.testing.assert_close(logits[0], _reference_logits(model, a + [50, 70])[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], _reference_logits(model, b + [60, 61])[-1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_catch_up_step_returns_each_sequences_last_logits(arch):
    """The static catch-up step (up to two tokens per sequence, the last one's logits): three sequences padded to
    the ladder's four, one and two new tokens mixed, one sequence cropped first; == the model's own forward, and
    the step (not the eager path) served it."""
    model = tiny_model(arch)
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=64, block_size=4))
        runner.enable_decode_graphs(4, 64, ladder=(1, 2, 4))
        catch_up = runner.enable_catch_up_graphs(4, 64, ladder=(1, 2, 4))
        prompts = PROMPTS[:2] + [PROMPTS[3]]
        runner.forward([0, 1, 2], _flat(prompts, model.device), [len(p) for p in prompts])
        runner.crop(2, len(prompts[2]) - 2)  # two tokens rolled back: it catches up on two others
        new = [[50, 51], [60], [70, 71]]
        served = []
        catch_up.run = lambda *args, real=catch_up.run: served.append(args[3]) or real(*args)
        logits = runner.forward([0, 1, 2], _flat(new, model.device), [2, 1, 2])
    assert served == [[2, 1, 2]] and logits.shape == (3, model.config.vocab_size)
    sequences = [prompts[0] + new[0], prompts[1] + new[1], prompts[2][:-2] + new[2]]
    for row, tokens in enumerate(sequences):
        torch.testing.assert_close(logits[row], _reference_logits(model, tokens)[-1], atol=1e-4, rtol=0)


def test_pool_full_changes_nothing():
    model = tiny_model("llama")
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=3, block_size=4))
        runner.forward([0], _flat([[5, 6, 7, 8, 9]], model.device), [5])  # 2 blocks
        with pytest.raises(CacheFullError, match="more blocks"):
            runner.forward([0, 1], _flat([[1], [2, 3, 4, 5, 6]], model.device), [1, 5])  # needs 2, has 1
        assert runner.seq_len(0) == 5 and 1 not in runner.cache.manager
        assert runner.cache.manager.num_free_blocks == 1
        runner.forward([0], _flat([[10]], model.device), [1])  # still usable


def test_bad_input():
    model = tiny_model("llama")
    with hfaccel_attention(model):
        runner = ModelRunner(model, KVPool.for_model(model, num_blocks=8, block_size=4))
        with pytest.raises(ValueError, match="sum\\(num_new\\)"):
            runner.forward([0], _flat([[1, 2]], model.device), [3])
        with pytest.raises(ValueError, match="at least one new token"):
            runner.forward([0, 1], _flat([[1, 2]], model.device), [2, 0])
        with pytest.raises(ValueError, match="distinct sequence id"):
            runner.forward([0, 0], _flat([[1], [2]], model.device), [1, 1])


def test_needs_hfaccel_attention():
    model = tiny_model("llama")
    runner = ModelRunner(model, KVPool.for_model(model, num_blocks=8, block_size=4))
    with pytest.raises(RuntimeError, match="needs the model's attention to be hfaccel's"):
        runner.forward([0], _flat([[1, 2]], model.device), [2])


def test_hfaccel_attention_restores_and_refuses_unsupported():
    model = tiny_model("qwen3")
    original = model.config._attn_implementation
    with hfaccel_attention(model, backend="torch"):
        assert model.config._attn_implementation == "hfaccel_torch"
    assert model.config._attn_implementation == original
    model.config.is_encoder_decoder = True  # a model hfaccel's attention cannot serve
    with pytest.raises(ValueError, match="cannot run on hfaccel's paged attention: encoder-decoder"):
        with hfaccel_attention(model):
            pass
    assert model.config._attn_implementation == original
