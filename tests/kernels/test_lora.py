"""Batched multi-LoRA: lora_shrink / lora_expand and the fused lora_apply (Triton, interpreted) vs their references
on odd sizes, mixed slots in one tile, zero-padded ranks, rows without an adapter (bit-exact), a split K, a row's
columns over several programs; the references vs a per-row naive matmul and under a fullgraph trace (no host sync);
the custom op compiled vs eager; sm_90 compilation."""

import importlib

import pytest
import torch
import triton

from hfaccel.kernels.lora import (
    FusedBlocks,
    LoraBlocks,
    expand_blocks,
    fused_blocks,
    lora_apply,
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
    shrink_blocks,
)
from hfaccel.kernels.ops import lora_op
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, assert_each_compiles_for_sm90, launch_like

lora_module = importlib.import_module("hfaccel.kernels.lora")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# relative to max |reference|: shrink's products are exact in fp32 whatever the input dtype (only the summation
# order differs); expand's output is rounded once to y's dtype (the interpreter truncates to bf16: 1 ulp)
SHRINK_TOLERANCE = 1e-5
EXPAND_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
RANKS = (4, 16, 1)  # the real ranks of slots 0, 1, 2 (zero-padded to R)
# (T, K, N, R): the pool's R at least each real rank it holds; slots' ranks below R are zero-padded
SHAPES = [(1, 19, 23, 16), (5, 64, 96, 16), (37, 130, 23, 16), (5, 130, 96, 8), (37, 19, 96, 1), (5, 64, 23, 12)]


def _pool(k: int, n: int, rank: int, dtype: torch.dtype, gen: torch.Generator):
    """``a [3, R, K]``, ``b [3, N, R]``: slot ``s`` of real rank ``min(RANKS[s], R)``, the rest zeros."""
    a = torch.randn(len(RANKS), rank, k, generator=gen) / k**0.5
    b = torch.randn(len(RANKS), n, rank, generator=gen)
    for s, real in enumerate(RANKS):
        a[s, real:] = 0
        b[s, :, real:] = 0
    return a.to(dtype), b.to(dtype)


def _index(rows: int, gen: torch.Generator, dtype=torch.int32) -> torch.Tensor:
    """Slots -1..2 at random, with every value present once the batch has 4 rows."""
    index = torch.randint(-1, len(RANKS), (rows,), generator=gen)
    index[:4] = torch.tensor([2, -1, 0, 1])[:rows]
    return index.to(dtype)


def _case(rows: int, k: int, n: int, rank: int, dtype: torch.dtype):
    """``a, b`` (:func:`_pool`), ``x [T, K]``, ``y [T, N]`` and an index (:func:`_index`) of one SHAPES entry."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + rank)
    a, b = _pool(k, n, rank, dtype, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y = torch.randn(rows, n, generator=gen).to(dtype)
    return a, b, x, y, _index(rows, gen)


def _naive_shrink(x, a, index):
    """Row by row: ``x[t] @ a[index[t]].T`` in fp64 (0 for -1)."""
    rows = [
        x[t].double() @ a[i].double().T if i >= 0 else torch.zeros(a.shape[1], dtype=torch.float64)
        for t, i in enumerate(index.tolist())
    ]
    return torch.stack(rows).reshape(x.shape[0], a.shape[1])


def _naive_expand(y, v, b, index):
    """Row by row: ``y[t] + v[t] @ b[index[t]].T`` in fp64 (``y[t]`` for -1)."""
    rows = [
        y[t].double() + v[t].double() @ b[i].double().T if i >= 0 else y[t].double()
        for t, i in enumerate(index.tolist())
    ]
    return torch.stack(rows).reshape(y.shape)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.double().abs().max().clamp_min(1e-30)
    return float((actual.double() - expected.double()).abs().max() / scale)


def _same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return torch.equal(actual.view(ints[actual.dtype]), expected.view(ints[expected.dtype]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, k, n, rank", SHAPES)
def test_kernels_match_references(rows, k, n, rank, dtype):
    a, b, x, y, index = _case(rows, k, n, rank, dtype)
    v = on_device(lora_shrink, x, a, index, backend="triton")
    v_ref = lora_shrink_reference(x, a, index)
    assert v.shape == (rows, rank) and v.dtype == torch.float32
    assert _relative_error(v, v_ref) <= SHRINK_TOLERANCE
    out = on_device(lora_expand, y, v_ref, b, index, backend="triton")
    out_ref = lora_expand_reference(y, v_ref, b, index)
    assert out.shape == y.shape and out.dtype == dtype
    assert _relative_error(out, out_ref) <= EXPAND_TOLERANCE[dtype]
    none = index < 0
    assert (v[none] == 0).all() and _same_bits(out[none], y[none])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, k, n, rank", SHAPES)
def test_fused_kernel_matches_references(rows, k, n, rank, dtype):
    a, b, x, y, index = _case(rows, k, n, rank, dtype)
    out = on_device(lora_apply, x, y, a, b, index, backend="triton", config=fused_blocks(rows, n, rank, k, DEVICE))
    expected = lora_expand_reference(y, lora_shrink_reference(x, a, index), b, index)
    assert out.shape == y.shape and out.dtype == dtype
    assert _relative_error(out, expected) <= EXPAND_TOLERANCE[dtype]
    none = index < 0
    assert _same_bits(out[none], y[none])


@pytest.mark.parametrize("config", [FusedBlocks(32, 16, programs_per_row=3), FusedBlocks(16, 32, 7, num_warps=4)])
def test_programs_sharing_a_row_agree_bit_for_bit(config):
    """A row's columns split over programs (the last share short; more programs asked than column blocks): each
    recomputes the row's v the same way, so the output is the one-program output, bit for bit."""
    gen = torch.Generator().manual_seed(11)
    a, b = _pool(130, 100, 16, torch.float16, gen)
    x, y = torch.randn(5, 130, generator=gen).half(), torch.randn(5, 100, generator=gen).half()
    index = _index(5, gen)
    one = on_device(lora_apply, x, y, a, b, index, backend="triton", config=FusedBlocks(32, 16))
    shared = on_device(lora_apply, x, y, a, b, index, backend="triton", config=config)
    assert _same_bits(shared, one)
    expected = lora_expand_reference(y, lora_shrink_reference(x, a, index), b, index)
    assert _relative_error(one, expected) <= EXPAND_TOLERANCE[torch.float16]


def test_apply_runs_shrink_then_expand_past_the_fused_rows(monkeypatch):
    """More rows than a decode step's (a prefill): shrink then expand, bit for bit what the two calls give."""
    gen = torch.Generator().manual_seed(12)
    a, b = _pool(64, 96, 16, torch.float32, gen)
    x, y, index = torch.randn(9, 64, generator=gen), torch.randn(9, 96, generator=gen), _index(9, gen)
    monkeypatch.setattr(lora_module, "FUSED_MAX_ROWS", 8)
    monkeypatch.setattr(lora_module, "_fused_triton", lambda *args: pytest.fail("the fused kernel ran"))
    out = on_device(lora_apply, x, y, a, b, index, backend="triton")
    v = on_device(lora_shrink, x, a, index, backend="triton")
    assert _same_bits(out, on_device(lora_expand, y, v, b, index, backend="triton"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_without_adapter_keep_y_bit_for_bit(dtype):
    """-0.0, inf and nan in y, nan and inf in x, in rows with index -1 (and one with a slot past the pool): those
    rows of v are 0 and of the output y's, bit for bit — in the kernel and the reference."""
    gen = torch.Generator().manual_seed(7)
    a, b = _pool(19, 23, 8, dtype, gen)
    x = torch.randn(6, 19, generator=gen).to(dtype)
    y = torch.randn(6, 23, generator=gen).to(dtype)
    index = torch.tensor([-1, 0, -1, 2, 3, -1], dtype=torch.int64)
    none = torch.tensor([True, False, True, False, True, True])
    x[0, 0], x[2, 1] = float("nan"), float("inf")
    y[0, :3] = torch.tensor([-0.0, float("inf"), float("nan")], dtype=dtype)
    y[5] = -0.0
    for backend in ("triton", "torch"):
        v = on_device(lora_shrink, x, a, index, backend=backend)
        out = on_device(lora_expand, y, v, b, index, backend=backend)
        assert torch.equal(v[none], torch.zeros(4, 8)) and torch.isfinite(v).all()
        assert _same_bits(out[none], y[none]), backend
        fused = on_device(lora_apply, x, y, a, b, index, backend=backend)
        assert _same_bits(fused[none], y[none]) and torch.isfinite(fused[~none]).all(), backend


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_mixed_slots_in_one_tile(index_dtype):
    """One program of 8 rows whose slots alternate (and two without one) against the per-row naive matmuls."""
    gen = torch.Generator().manual_seed(3)
    a, b = _pool(64, 96, 16, torch.float32, gen)
    x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 96, generator=gen)
    index = torch.tensor([0, 2, -1, 1, 0, 2, 1, -1], dtype=index_dtype)
    v = on_device(lora_shrink, x, a, index, backend="triton", config=LoraBlocks(8, 16, 64))
    assert _relative_error(v, _naive_shrink(x, a, index)) <= SHRINK_TOLERANCE
    out = on_device(lora_expand, y, v, b, index, backend="triton", config=LoraBlocks(8, 128, 16))
    assert _relative_error(out, _naive_expand(y, v, b, index)) <= EXPAND_TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "config", [LoraBlocks(2, 4, 16, split_k=3), LoraBlocks(4, 8, 32, split_k=8), LoraBlocks(1, 1, 16, num_warps=1)]
)
def test_shrink_split_k_and_small_tiles(config):
    """Split K (the last split short, and more splits asked than K-blocks) and tiles smaller than the batch."""
    gen = torch.Generator().manual_seed(4)
    a, _ = _pool(130, 8, 16, torch.float16, gen)
    x = torch.randn(5, 130, generator=gen).half()
    index = _index(5, gen)
    v = on_device(lora_shrink, x, a, index, backend="triton", config=config)
    assert _relative_error(v, lora_shrink_reference(x, a, index)) <= SHRINK_TOLERANCE


def test_expand_small_tiles_loop_over_rank():
    gen = torch.Generator().manual_seed(5)
    _, b = _pool(8, 23, 16, torch.bfloat16, gen)
    y, v = torch.randn(5, 23, generator=gen).bfloat16(), torch.randn(5, 16, generator=gen)
    index = _index(5, gen)
    out = on_device(lora_expand, y, v, b, index, backend="triton", config=LoraBlocks(2, 8, 4))
    assert _relative_error(out, lora_expand_reference(y, v, b, index)) <= EXPAND_TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_references_match_per_row_matmuls(dtype):
    """The references (all slots, or a ``slots`` hint holding every slot that appears, int32 or int64 index)
    against row-by-row fp64 matmuls; a hint that leaves a slot out makes its rows adapter-free."""
    gen = torch.Generator().manual_seed(6)
    a, b = _pool(130, 96, 16, dtype, gen)
    x, y = torch.randn(37, 130, generator=gen).to(dtype), torch.randn(37, 96, generator=gen).to(dtype)
    index = _index(37, gen, torch.int64)
    expected_v = _naive_shrink(x, a, index)
    for slots, idx in ((None, index), ([2, 0, 1, 1, 9], index.int())):
        v = lora_shrink_reference(x, a, idx, slots)
        assert v.dtype == torch.float32 and _relative_error(v, expected_v) <= 1e-5
        out = lora_expand_reference(y, v, b, idx, slots)
        assert out.dtype == dtype
        assert _relative_error(out, _naive_expand(y, v, b, idx)) <= EXPAND_TOLERANCE[dtype]
    v = lora_shrink_reference(x, a, index, slots=[0, 2])
    out = lora_expand_reference(y, v, b, index, slots=[0, 2])
    ones = index == 1
    assert (v[ones] == 0).all() and _same_bits(out[ones], y[ones])
    assert _relative_error(v[~ones], expected_v[~ones]) <= 1e-5


def test_references_trace_without_host_syncs():
    """A fullgraph trace fails on a host read of the index (.item(), nonzero, boolean-mask indexing)."""
    gen = torch.Generator().manual_seed(8)
    a, b = _pool(19, 23, 8, torch.float16, gen)
    x, y = torch.randn(5, 19, generator=gen).half(), torch.randn(5, 23, generator=gen).half()
    index = _index(5, gen)

    def step(x, y, index):
        return lora_expand_reference(y, lora_shrink_reference(x, a, index), b, index)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    assert _same_bits(compiled(x, y, index), step(x, y, index))


def test_auto_runs_the_reference_off_cuda():
    gen = torch.Generator().manual_seed(9)
    a, b = _pool(19, 23, 8, torch.float32, gen)
    x, y, index = torch.randn(5, 19, generator=gen), torch.randn(5, 23, generator=gen), _index(5, gen)
    assert torch.equal(lora_shrink(x, a, index), lora_shrink_reference(x, a, index))
    v = lora_shrink_reference(x, a, index)
    assert torch.equal(lora_expand(y, v, b, index, slots=[0, 1, 2]), lora_expand_reference(y, v, b, index))


def test_empty_batch_and_bad_arguments():
    a, b = torch.zeros(2, 4, 8), torch.zeros(2, 6, 4)
    empty = torch.zeros(0, dtype=torch.int32)
    assert on_device(lora_shrink, torch.zeros(0, 8), a, empty, backend="triton").shape == (0, 4)
    assert on_device(lora_expand, torch.zeros(0, 6), torch.zeros(0, 4), b, empty, backend="triton").shape == (0, 6)
    index = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="index must be int32 or int64"):
        lora_shrink(torch.zeros(3, 8), a, index.float())
    with pytest.raises(ValueError, match="a must be"):
        lora_shrink(torch.zeros(3, 7), a, index)
    with pytest.raises(ValueError, match="v must be"):
        lora_expand(torch.zeros(3, 6), torch.zeros(3, 5), b, index)
    assert on_device(lora_apply, torch.zeros(0, 8), torch.zeros(0, 6), a, b, empty, backend="triton").shape == (0, 6)
    with pytest.raises(ValueError, match=r"b must be \[S, N, R\] = \[2, 6, 4\]"):
        lora_apply(torch.zeros(3, 8), torch.zeros(3, 6), a, b[:, :, :3], index)
    with pytest.raises(ValueError, match="y must be"):
        lora_apply(torch.zeros(3, 8), torch.zeros(2, 6), a, b, index)


def test_custom_op_compiles_without_graph_breaks():
    """torch.ops.hfaccel.lora: schema and fake implementation agree (opcheck), and a fullgraph trace of a LoRA'd
    linear (glue around the op) equals the eager call."""
    gen = torch.Generator().manual_seed(10)
    a, b = (t.to(DEVICE) for t in _pool(64, 96, 16, torch.float16, gen))
    weight = (torch.randn(96, 64, generator=gen) / 8).half().to(DEVICE)
    x = torch.randn(5, 64, generator=gen).half().to(DEVICE)
    index = _index(5, gen).to(DEVICE)
    torch.library.opcheck(lora_op, (x, x @ weight.T, a, b, index, None, "auto"))
    torch.library.opcheck(lora_op, (x, x @ weight.T, a, b, index, [0, 1, 2], "auto"))

    def linear(x, index):
        return lora_op(x * 2, x @ weight.T, a, b, index, None, "auto") + 1

    compiled = torch.compile(linear, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, index), linear(x, index))
    assert compiled(x, index).dtype == torch.float16


# ----------------------------------------------------------------------------------------------- sm_90 compilation

# (T, R, K or N)
GPU_SHAPES = [(1, 16, 4096), (8, 8, 4096), (5, 8, 4096), (64, 64, 4096), (512, 16, 14336), (3, 128, 2048)]


def _sm90_cases():
    """(kernel, dtype, index dtype, blocks, R) of the launches the heuristics pick on an H100 for GPU_SHAPES: every
    one in fp16 (int32 index), the first of each kernel in fp32 (int64 index) and bf16 too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lora_module, "num_sms", lambda device: 132)
        cases = set()
        for rows, rank, width in GPU_SHAPES:
            cases.add(("shrink", shrink_blocks(rows, rank, width, "cuda"), rank))
            cases.add(("expand", expand_blocks(rows, width, rank, "cuda"), rank))
            cases.add(("fused", fused_blocks(rows, width, rank, width, "cuda"), rank))
    cases = sorted(cases, key=str)
    firsts = [next(case for case in cases if case[0] == kernel) for kernel in ("shrink", "expand", "fused")]
    return (
        [(kernel, torch.float16, torch.int32, cfg, rank) for kernel, cfg, rank in cases]
        + [(kernel, torch.float32, torch.int64, cfg, rank) for kernel, cfg, rank in firsts]
        + [(kernel, torch.bfloat16, torch.int32, cfg, rank) for kernel, cfg, rank in firsts]
    )


SM90_CASES = _sm90_cases()


def _sm90_job(kernel_name, dtype, index_dtype, cfg, rank):
    dt, it = TRITON_TYPES[dtype], TRITON_TYPES[index_dtype]
    if kernel_name == "shrink":
        kernel = lora_module._shrink_kernel
        signature = {
            "X": f"*{dt}",
            "A": f"*{dt}",
            "INDEX": f"*{it}",
            "V": "*fp32",
            **dict.fromkeys(
                ["T", "K", "R", "S", "k_per_split", "stride_xt", "stride_as", "stride_ar", "stride_vs", "stride_vt"],
                "i32",
            ),
        }
        constexprs = {"BLOCK_T": cfg.block_t, "BLOCK_R": cfg.block_out, "BLOCK_K": cfg.block_red}
    elif kernel_name == "fused":
        kernel = lora_module._fused_kernel
        signature = {
            "X": f"*{dt}",
            "A": f"*{dt}",
            "B": f"*{dt}",
            "Y": f"*{dt}",
            "INDEX": f"*{it}",
            "OUT": f"*{dt}",
            **dict.fromkeys(
                [
                    "K",
                    "N",
                    "S",
                    "n_per_program",
                    "stride_xt",
                    "stride_as",
                    "stride_ar",
                    "stride_bs",
                    "stride_yt",
                    "stride_ot",
                ],
                "i32",
            ),
        }
        constexprs = {
            "R": rank,
            "BLOCK_R": triton.next_power_of_2(rank),
            "BLOCK_K": cfg.block_k,
            "BLOCK_N": cfg.block_n,
        }
    else:
        kernel = lora_module._expand_kernel
        signature = {
            "Y": f"*{dt}",
            "VV": "*fp32",
            "B": f"*{dt}",
            "INDEX": f"*{it}",
            "OUT": f"*{dt}",
            **dict.fromkeys(["T", "N", "S", "stride_yt", "stride_vt", "stride_bs", "stride_ot"], "i32"),
        }
        constexprs = {"R": rank, "BLOCK_T": cfg.block_t, "BLOCK_N": cfg.block_out, "BLOCK_R": cfg.block_red}
    job = dict(
        module="hfaccel.kernels.lora",
        kernel=kernel.__name__,
        num_warps=cfg.num_warps,
        num_stages=1,
        ptx_patterns=["ld.global.v4", ".local"],
        **launch_like(kernel, signature, constexprs),
    )
    job["divisible"] += [
        name for name in ("K", "N", "k_per_split", "n_per_program") if name in signature
    ]  # 4096 and such: 16 | it
    return job


@pytest.mark.slow
def test_compiles_for_sm90():
    def check(case, result):
        assert result["shared"] <= 227 * 1024
        counts = result["ptx_counts"]
        assert counts["ld.global.v4"] > 0 and counts[".local"] == 0, (
            "the gathered rows must load 128 bits at a time, with no spills"
        )

    assert_each_compiles_for_sm90(SM90_CASES, [_sm90_job(*case) for case in SM90_CASES], check)


def test_heuristics_split_k_for_decode_only():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lora_module, "num_sms", lambda device: 132)
        assert shrink_blocks(1, 16, 4096, "cuda").split_k > 1
        assert shrink_blocks(4096, 16, 4096, "cuda").split_k == 1
        for cfg in (shrink_blocks(512, 64, 4096, "cuda"), expand_blocks(512, 4096, 64, "cuda")):
            assert cfg.block_t * cfg.block_out * cfg.block_red <= lora_module.TILE_ELEMENTS
    assert shrink_blocks(1, 16, 4096, "cpu").split_k == 1
