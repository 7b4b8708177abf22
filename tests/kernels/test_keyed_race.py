"""keyed_race: the seeded draw's Triton kernel (through the interpreter) picks the reference's token on every row —
odd vocabularies, extreme seeds, zero weights —, draws exactly from the weights (chi-square), the same token alone
or in a batch; it compiles for sm_90; and its custom op (what a compiled decode step's draw calls) traces whole."""

import pytest
import torch

from hfaccel.kernels.keyed_race import BLOCK_V, START, keyed_race, keyed_race_reference, seeded_uniforms
from tests.devices import on_device
from tests.kernels.helpers import compile_sm90
from tests.sampling.reference import chi_square_p_value

SEEDS = [0, -1, 1, 2**63 - 1, -(2**63), 12345, 2**32, -(2**40) + 7]


def test_the_custom_op_matches_the_launcher_and_traces_whole():
    """torch.ops.hfaccel.keyed_race: schema and fake implementation agree (opcheck), a fullgraph trace equals the
    eager call, on an odd vocabulary."""
    from hfaccel.kernels.ops import keyed_race_op

    gen = torch.Generator().manual_seed(3)
    weights = torch.rand(5, 97, generator=gen)
    seeds, streams, counters, _ = _keys(5, gen)
    expected = keyed_race(weights, seeds, streams, counters, 1)
    assert torch.equal(keyed_race_op(weights, seeds, streams, counters, 1, "auto"), expected)
    torch.library.opcheck(keyed_race_op, (weights, seeds, streams, counters, 1, "auto"))
    compiled = torch.compile(
        lambda w, s, t, c: keyed_race_op(w * 2, s, t, c, 1, "auto"), fullgraph=True, backend="aot_eager"
    )
    assert torch.equal(compiled(weights, seeds, streams, counters), expected)


def _keys(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    seeds = torch.tensor([SEEDS[i % len(SEEDS)] ^ (i // len(SEEDS)) for i in range(rows)])  # within int64
    streams = torch.randint(0, 4, (rows,), generator=gen)
    counters = torch.randint(0, 2**32, (rows,), generator=gen)
    purpose = torch.randint(0, 3, (rows,), generator=gen)
    return seeds, streams, counters, purpose


@pytest.mark.parametrize("vocab", [1, 97, BLOCK_V, 2 * BLOCK_V + 13])
def test_kernel_picks_the_references_token(vocab):
    """40 rows of peaked and flat weights, every eighth token's weight 0 (never chosen)."""
    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(40, vocab, generator=gen) ** torch.linspace(0.5, 8, 40)[:, None]  # [40, V]
    weights[:, 1::8] = 0
    keys = _keys(40, gen)
    got = on_device(keyed_race, weights, *keys, backend="triton")
    assert got.dtype == torch.int64 and got.tolist() == keyed_race_reference(weights, *keys).tolist()
    assert (got % 8 != 1).all()


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_the_rows_programs_pick_the_references_token_however_many(chunks):
    """A row's tokens raced by several programs (a small batch over a large vocabulary): the same token as one
    program and as the reference, chunks of whole blocks, the last one short; a row whose best weight sits in a
    later chunk and one whose only weights sit in the first."""
    vocab = 4 * BLOCK_V + 37
    gen = torch.Generator().manual_seed(chunks)
    weights = torch.rand(5, vocab, generator=gen) ** 6  # [5, V]
    weights[1, : 3 * BLOCK_V] = 0  # the winner in the fourth or fifth block
    weights[2, BLOCK_V:] = 0  # every candidate in the first block
    keys = _keys(5, gen)
    got = on_device(keyed_race, weights, *keys, backend="triton", chunks=chunks)
    assert got.tolist() == keyed_race_reference(weights, *keys).tolist()
    assert got[1] >= 3 * BLOCK_V and got[2] < BLOCK_V


def test_int_keys_broadcast_and_a_batch_changes_no_row():
    gen = torch.Generator().manual_seed(1)
    weights = torch.rand(6, 301, generator=gen)
    counters = torch.arange(6) * 11
    together = on_device(keyed_race, weights, 42, 1, counters, 2, backend="triton")
    alone = [
        on_device(keyed_race, weights[i : i + 1], 42, 1, counters[i : i + 1], 2, backend="triton").item()
        for i in range(6)
    ]
    assert together.tolist() == alone
    assert together.tolist() == keyed_race(weights, 42, 1, counters, 2, backend="torch").tolist()


def test_kernel_draws_exactly_from_the_weights():
    """One row of 7 weights (one 0) raced under 3000 keys: the counts fit the weights (chi-square)."""
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.25, 0.2, 0.05])
    draws = 3000
    tokens = on_device(keyed_race, probs.expand(draws, -1) * 3.0, 7, 0, torch.arange(draws), backend="triton")
    counts = torch.bincount(tokens, minlength=7)
    assert counts[2] == 0
    assert chi_square_p_value(counts, probs) > 1e-3


def test_hash_of_the_all_zero_key_is_not_zero():
    assert seeded_uniforms(torch.tensor(0), 0).item() > 1e-6 and START != 0


def test_kernel_compiles_for_sm90():
    signature = {
        "weights_ptr": "*fp32",
        "seeds_ptr": "*i64",
        "streams_ptr": "*i64",
        "counters_ptr": "*i64",
        "purpose_ptr": "*i64",
        "score_ptr": "*fp32",
        "index_ptr": "*i64",
        "vocab": "i32",
        "stride_row": "i32",
        "blocks_per_chunk": "i32",
    }
    job = dict(
        module="hfaccel.kernels.keyed_race",
        kernel="_keyed_race_kernel",
        signature=signature,
        constexprs={"START": START, "BLOCK": BLOCK_V},
        num_warps=4,
        num_stages=1,
        divisible=["weights_ptr", "stride_row"],
    )
    (result,) = compile_sm90([job])
    assert result["ok"], result.get("error")


def test_int_keys_are_filled_on_the_device_without_an_upload():
    """A key given as one int (the draw's purpose, a request's seed) is made on the device, not copied from the
    host: on CUDA such a copy would wait for the device, and fail inside a CUDA graph capture."""
    from tests.speculative.host_reads import HostReads

    gen = torch.Generator().manual_seed(4)
    weights = torch.rand(3, 41, generator=gen)
    counters = torch.tensor([1, 2, 3])
    with HostReads() as waits:
        got = keyed_race(weights, 7, 1, counters, 2, backend="torch")
    assert waits.uploads == [] and waits.reads == []
    expected = keyed_race(
        weights, torch.full((3,), 7), torch.ones(3, dtype=torch.long), counters, torch.full((3,), 2), backend="torch"
    )
    assert torch.equal(got, expected)
