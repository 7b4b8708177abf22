"""fp8_matmul (Triton, interpreted) vs its references on every path (GEMV, GEMM and dequantize + dense matmul vs
fp8_reference; W8A8 vs w8a8_reference), every scale layout (per output channel, 128×128-style blocks with partial
edge blocks, per tensor), odd sizes, each activation dtype; the router and its tuned entries; the custom op under a
fullgraph trace; bad inputs; sm_90 compilation of the kernels."""

import pytest
import torch

from hfaccel.kernels.fp8 import FP8_DTYPE, dequantize, fp8_matmul, fp8_reference, quantize_activations, w8a8_reference
from hfaccel.kernels.fp8_config import (
    DEQUANT_MIN_M,
    GEMV_MAX_M,
    OP,
    W8A8_MIN_M,
    Fp8Config,
    candidate_configs,
    fit_config,
    heuristic_config,
    pick_fp8_config,
    table_key,
)
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, assert_each_compiles_for_sm90

# relative to max|reference|: the GEMM and dequant paths round the dequantized weight (exact in 16 bits) times
# nothing, but the dequant path rounds weight * scale to the activation dtype, and outputs are rounded once
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (K, N, group_k, group_n): per channel, blocks of 64 (partial edge blocks), per tensor — N never a power of two
LAYOUTS = [(200, 77, 200, 1), (192, 136, 64, 64), (96, 33, 96, 33)]


def _weights(k, n, group_k, group_n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(k, n, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    scales = torch.rand(-(-k // group_k), -(-n // group_n), generator=gen) * 0.02 + 0.001
    return weight, scales


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["gemv", "gemm", "dequant"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["per channel", "blocks", "per tensor"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_every_weight_only_path_matches_reference(m, layout, path, dtype):
    k, n, group_k, group_n = layout
    weight, scales = _weights(k, n, group_k, group_n)
    x = torch.randn(m, k).to(dtype)
    out = on_device(fp8_matmul, x, weight, scales, group_k, group_n, backend="triton", path=path)
    ref = fp8_reference(x, weight, scales, group_k, group_n)
    assert out.shape == (m, n) and out.dtype == dtype
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= TOLERANCE[dtype], f"{path}: max error {error:.3g} of the output scale"


# blocks of 32 (the fp8 tensor cores' smallest K tile) with partial edge blocks, and per channel / per tensor
W8A8_LAYOUTS = [(200, 77, 200, 1), (160, 136, 32, 64), (96, 33, 96, 33)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", W8A8_LAYOUTS, ids=["per channel", "blocks", "per tensor"])
@pytest.mark.parametrize("m", [5, 37])
def test_w8a8_matches_its_reference(m, layout, dtype):
    """fp8 x fp8 tensor-core tiles against the activations quantized the same way in torch (both operands exact in
    fp32, so only the sum's order and the output's rounding differ); and within e4m3's rounding of the weight-only
    product."""
    k, n, group_k, group_n = layout
    weight, scales = _weights(k, n, group_k, group_n)
    x = torch.randn(m, k).to(dtype)
    out = on_device(fp8_matmul, x, weight, scales, group_k, group_n, backend="triton", path="w8a8")
    ref = w8a8_reference(x, weight, scales, group_k, group_n)
    assert out.shape == (m, n) and out.dtype == dtype
    scale = ref.float().abs().max()
    assert (out.float() - ref.float()).abs().max() / scale <= TOLERANCE[dtype]
    # each activation rounded to 3 mantissa bits (within 2^-4 of itself): the product within 2^-4 of |x| @ |W|
    weight_only = fp8_reference(x, weight, scales, group_k, group_n).float()
    bound = 2**-4 * (x.float().abs() @ dequantize(weight, scales, group_k, group_n).abs()) + TOLERANCE[dtype] * scale
    assert ((ref.float() - weight_only).abs() <= bound).all()


def test_activations_quantize_per_token_and_group():
    x = torch.randn(3, 100) * torch.tensor([[1.0], [50.0], [0.01]])
    quantized, scales = quantize_activations(x, 32)  # groups of 32, the last of 4
    assert quantized.dtype == FP8_DTYPE and scales.shape == (3, 4)
    torch.testing.assert_close(scales[:, 0], x[:, :32].abs().amax(dim=1) / 448)
    assert quantized.float().abs().amax(dim=1).eq(448).all()  # every row's largest value maps to e4m3's largest
    error = (quantized.float() * scales.repeat_interleave(32, 1)[:, :100] - x).abs()
    assert (error <= x.abs() / 16 + scales.repeat_interleave(32, 1)[:, :100] * 2**-9).all()
    assert quantize_activations(x, 1000)[1].shape == (3, 1)  # one group: per token


def test_router_by_rows_and_device():
    """Without a tuned table: the GEMV for decode rows, 16-bit tensor cores between, and from large M fp8 tensor
    cores where they run (16-bit activations on a GPU of sm_89+), else the dequantized weight's dense matmul."""
    k = 4096
    n = k = 4096
    assert heuristic_config(1, n, k, torch.bfloat16, k).path == "gemv"
    assert heuristic_config(GEMV_MAX_M, n, k, torch.bfloat16, k).path == "gemv"
    assert heuristic_config(GEMV_MAX_M + 1, n, k, torch.bfloat16, k).path == "gemm"
    assert heuristic_config(W8A8_MIN_M, n, k, torch.bfloat16, k, w8a8=True).path == "w8a8"
    assert heuristic_config(W8A8_MIN_M, n, k, torch.bfloat16, k).path == "gemm"
    assert heuristic_config(DEQUANT_MIN_M, n, k, torch.bfloat16, k).path == "dequant"
    assert heuristic_config(DEQUANT_MIN_M, n, k, torch.bfloat16, k, w8a8=True).path == "w8a8"
    assert pick_fp8_config(4096, n, k, torch.bfloat16, k, 1, "cpu").path == "dequant"  # never w8a8 off CUDA
    assert heuristic_config(64, n, 96, torch.bfloat16, 24).path == "dequant"  # groups too small for a K tile of 16


def test_splits_k_while_tiles_leave_sms_idle():
    """Decode rows over a narrow N (a KV projection) and small tensor-core batches split K; an LM head, or tiles that
    fill the GPU, do not; the split follows the GPU's SM count."""
    k = 4096
    assert heuristic_config(1, 1024, k, torch.bfloat16, k).split_k > 1
    assert heuristic_config(1, 1024, k, torch.bfloat16, 128).split_k > 1  # block weights: K tiles inside blocks
    assert heuristic_config(16, 4096, k, torch.bfloat16, k).split_k > 1
    assert heuristic_config(W8A8_MIN_M, 4096, k, torch.bfloat16, k, w8a8=True).split_k > 1
    assert heuristic_config(1, 128256, k, torch.bfloat16, k).split_k == 1
    assert heuristic_config(512, 14336, k, torch.bfloat16, k).split_k == 1
    assert heuristic_config(DEQUANT_MIN_M, 4096, k, torch.bfloat16, k).split_k == 1
    # a KV projection at M = 512 leaves SMs idle, but split partials would move more bytes than its weight
    assert heuristic_config(512, 1024, k, torch.bfloat16, k, w8a8=True).split_k == 1
    small_gpu = heuristic_config(1, 1024, k, torch.bfloat16, k, sms=16).split_k
    assert 1 <= small_gpu < heuristic_config(1, 1024, k, torch.bfloat16, k).split_k
    assert fit_config(Fp8Config("gemv", block_k=64, split_k=64), 200, 200).split_k == 4  # no more splits than tiles
    assert fit_config(Fp8Config("dequant", split_k=4), 200, 200).split_k == 1
    with pytest.raises(ValueError, match="split_k must be an int >= 1"):
        Fp8Config("gemv", split_k=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "config",
    [
        Fp8Config("gemv", block_n=32, block_k=16, split_k=3),
        Fp8Config("gemm", block_m=16, block_n=32, block_k=16, split_k=3),
        Fp8Config("w8a8", block_m=16, block_n=32, block_k=32, split_k=2),
    ],
    ids=lambda c: c.path,
)
def test_split_k_matches_reference_and_repeats_bit_exactly(config, dtype):
    """Each tiled path with K split unevenly (the last slice shorter, K tiles inside 64-row blocks): the reference's
    result within the dtype's tolerance, and the same bits on every run (partials added in split order)."""
    if config.path == "w8a8" and dtype == torch.float32:
        pytest.skip("w8a8 takes 16-bit activations")
    k, n, group_k, group_n = 200, 77, 64, 64
    weight, scales = _weights(k, n, group_k, group_n)
    x = torch.randn(5, k).to(dtype)
    out = on_device(fp8_matmul, x, weight, scales, group_k, group_n, backend="triton", config=config)
    reference = w8a8_reference if config.path == "w8a8" else fp8_reference
    ref = reference(x, weight, scales, group_k, group_n)
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= TOLERANCE[dtype], f"{config.label}: max error {error:.3g} of the output scale"
    again = on_device(fp8_matmul, x, weight, scales, group_k, group_n, backend="triton", config=config)
    assert torch.equal(out, again)


def test_k_tiles_never_span_two_groups():
    assert fit_config(Fp8Config("gemm", block_k=64), 4096, 128).block_k == 64
    assert fit_config(Fp8Config("w8a8", block_k=128), 4096, 128).block_k == 128
    assert fit_config(Fp8Config("gemm", block_k=64), 200, 200).block_k == 64
    assert fit_config(Fp8Config("gemv", block_k=64), 96, 32).block_k == 32
    with pytest.raises(ValueError, match="not a multiple of 16"):
        fit_config(Fp8Config("gemm"), 96, 24)
    with pytest.raises(ValueError, match="not a multiple of 32"):
        fit_config(Fp8Config("w8a8", block_k=64), 96, 16)
    with pytest.raises(ValueError, match="block_m >= 16 and block_k >= 32"):
        Fp8Config("w8a8", block_k=16)


def test_a_table_measured_for_decode_never_sends_a_prefill_to_the_gemv(tuned_table):
    """Entries measured at M = 1 and 16 only (``hfaccel tune --m 1 --m 16``, or a sweep stopped part way) serve the M
    buckets next to them; larger M, and M equally far from both, take the heuristics."""
    n, k = 4096, 4096
    gemv = Fp8Config("gemv", block_n=128, block_k=128, num_warps=2, num_stages=1, split_k=4)
    tuned_table({OP: {table_key(m, n, k, torch.bfloat16, k, 1): {**gemv.entry(), "us": 3.0} for m in (1, 16)}})
    assert pick_fp8_config(2, n, k, torch.bfloat16, k, 1, "cuda") == gemv
    assert pick_fp8_config(32, n, k, torch.bfloat16, k, 1, "cuda") == gemv
    for m in (4, 64, 128, 4096):
        assert pick_fp8_config(m, n, k, torch.bfloat16, k, 1, "cuda") == heuristic_config(m, n, k, torch.bfloat16, k)


def test_k_of_zero_gives_zeros():
    weight, scales = torch.zeros(0, 33, dtype=FP8_DTYPE), torch.zeros(0, 33)
    for path in ("gemv", "gemm"):
        out = on_device(fp8_matmul, torch.randn(3, 0), weight, scales, 64, 1, backend="triton", path=path)
        assert out.shape == (3, 33) and not out.any()


def test_tuned_entries_are_read_nearest_m_first(tuned_table):
    """A tuned table's entry serves its bucket and the M buckets nearest it; an entry the call cannot use (w8a8
    for fp32 activations, or a K tile across groups it cannot shrink) warns and the heuristics serve."""
    n, k = 4096, 4096
    w8a8 = Fp8Config("w8a8", 64, 128, 128, 8, 4)
    gemv = Fp8Config("gemv", block_n=128, block_k=128, num_warps=2, num_stages=1)
    tuned_table(
        {
            OP: {
                table_key(256, n, k, torch.bfloat16, k, 1): {**w8a8.entry(), "us": 9.0},
                table_key(1, n, k, torch.bfloat16, k, 1): {**gemv.entry(), "us": 3.0},
                table_key(256, n, k, torch.float32, k, 1): {**w8a8.entry(), "us": 9.0},
            }
        }
    )
    assert pick_fp8_config(256, n, k, torch.bfloat16, k, 1, "cuda") == w8a8
    assert pick_fp8_config(512, n, k, torch.bfloat16, k, 1, "cuda") == w8a8  # nearest measured M
    assert pick_fp8_config(1, n, k, torch.bfloat16, k, 1, "cuda") == gemv
    with pytest.warns(UserWarning, match="unusable"):
        assert pick_fp8_config(256, n, k, torch.float32, k, 1, "cuda").path != "w8a8"
    assert table_key(3, n, k, torch.bfloat16, 128, 128) == "m4_n4096_k4096_g128x128_dtypebfloat16"
    assert table_key(1, n, k, torch.float16, k, n) == "m1_n4096_k4096_gtensor_dtypefloat16"


def test_candidates_fit_the_shape():
    found = candidate_configs(1, 4096, torch.bfloat16, 128)
    assert {c.path for c in found} == {"gemv", "gemm", "w8a8", "dequant"}
    assert all(c.block_k <= 128 for c in found) and len(found) == len(set(found))
    assert "w8a8" not in {c.path for c in candidate_configs(256, 4096, torch.float32, 4096)}
    assert "gemv" not in {c.path for c in candidate_configs(256, 4096, torch.bfloat16, 4096)}


def test_custom_op_traces_without_graph_breaks():
    from hfaccel.kernels.ops import fp8_matmul_op

    weight, scales = (t.to(DEVICE) for t in _weights(192, 136, 64, 64))
    x = torch.randn(3, 192, device=DEVICE).half()
    # opcheck's schema test compares the inputs before and after with arithmetic torch has no fp8 CPU kernel for
    torch.library.opcheck(
        fp8_matmul_op,
        (x, weight, scales, 64, 64, "auto"),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )
    fn = torch.compile(
        lambda x: fp8_matmul_op(x * 2, weight, scales, 64, 64, "auto") + 1, fullgraph=True, backend="aot_eager"
    )
    expected = fp8_reference(x * 2, weight, scales, 64, 64) + 1
    error = (fn(x).float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= TOLERANCE[torch.float16]


def test_bad_inputs():
    weight, scales = _weights(192, 136, 64, 64)
    x = torch.randn(2, 192).half()
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[K, N\\]"):
        fp8_matmul(torch.randn(2, 100).half(), weight, scales, 64, 64)
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        fp8_matmul(x, weight.float(), scales, 64, 64)
    with pytest.raises(ValueError, match="scales must be fp32"):
        fp8_matmul(x, weight, scales[:1], 64, 64)
    with pytest.raises(ValueError, match="path must be one of"):
        fp8_matmul(x, weight, scales, 64, 64, backend="triton", path="wgmma")
    with pytest.raises(ValueError, match="the w8a8 path takes"):
        fp8_matmul(x.float(), weight, scales, 64, 64, backend="triton", path="w8a8")


# ---- sm_90 compilation ------------------------------------------------------------------------------------------
def _job(
    dtype,
    kernel: str,
    block_m: int,
    block_k: int,
    block_n: int = 64,
    num_warps: int = 4,
    w8a8: bool = False,
    split: bool = False,
):
    """A compile job specialised as a per-channel launch at model shapes is: ``group_n`` the constant 1, the
    pointers, sizes and strides divisible by 16."""
    ptr = "*" + TRITON_TYPES[dtype]
    ints = ["N", "K", "group_k", "k_per_split", "stride_xm", "stride_wk", "stride_sk", "stride_os", "stride_om"]
    signature = {name: "i32" for name in ints}
    signature.update(X="*fp8e4nv" if w8a8 else ptr, W="*fp8e4nv", S="*fp32", OUT="*fp32" if split else ptr)
    constexprs = dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, group_n=1)
    if kernel == "_gemm_kernel":
        signature.update(M="i32", XS="*fp32", stride_xsm="i32")
        constexprs.update(BLOCK_M=block_m, F32_DOT=dtype == torch.float32, W8A8=w8a8)
    return dict(
        module="hfaccel.kernels.fp8",
        kernel=kernel,
        signature=signature,
        constexprs=constexprs,
        divisible=["X", "W", "S", "OUT", *ints],
        num_warps=num_warps,
        num_stages=3,
        ptx_patterns=["ld.global.v4", "ld.global.b8"],
    )


SM90_KERNELS = [
    (dtype, kernel, block_m, block_k)
    for dtype in DTYPES
    for block_k in (64, 32, 16)
    for kernel, block_m in (("_gemv_kernel", 1), ("_gemm_kernel", 16), ("_gemm_kernel", 64))
]
# the fp8 tensor-core tiles: the heuristics' 128x128x128 (8 warps), and small-M and block-32 ones
SM90_KERNELS += [
    (dtype, "_gemm_kernel", block_m, block_k, block_n, warps, True)
    for dtype in (torch.float16, torch.bfloat16)
    for block_m, block_k, block_n, warps in ((128, 128, 128, 8), (16, 64, 64, 4), (64, 32, 128, 4))
]
# split K: each path's fp32-partials variant
SM90_KERNELS += [
    (torch.bfloat16, "_gemv_kernel", 1, 64, 64, 4, False, True),
    (torch.bfloat16, "_gemm_kernel", 16, 64, 64, 4, False, True),
    (torch.bfloat16, "_gemm_kernel", 128, 128, 128, 8, True, True),
]


@pytest.mark.slow
def test_compiles_for_sm90():
    def check(case, result):
        assert result["shared"] <= 227 * 1024
        if case[1] == "_gemv_kernel":
            counts = result["ptx_counts"]
            assert counts["ld.global.v4"] > 0 and counts["ld.global.b8"] == 0, (
                f"the GEMV must stream the fp8 weight in 128-bit loads, not byte by byte ({counts})"
            )

    assert_each_compiles_for_sm90(SM90_KERNELS, [_job(*case) for case in SM90_KERNELS], check)
