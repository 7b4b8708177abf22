"""fp8_matmul (Triton, interpreted) vs fp8_reference on every path (GEMV, GEMM, dequantize + dense matmul), every
scale layout (per output channel, 128×128-style blocks with partial edge blocks, per tensor), odd sizes, each
activation dtype; the router; the custom op under a fullgraph trace; bad inputs; sm_90 compilation of the kernels."""

import pytest
import torch

from hfaccel.kernels.fp8 import (DEQUANT_MIN_M, FP8_DTYPE, GEMV_MAX_M, PATHS, _block_k, fp8_matmul, fp8_reference,
                                 pick_path)
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import TRITON_TYPES, compile_sm90

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
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["per channel", "blocks", "per tensor"])
@pytest.mark.parametrize("m", [1, 5, 37])
def test_every_path_matches_reference(m, layout, path, dtype):
    k, n, group_k, group_n = layout
    weight, scales = _weights(k, n, group_k, group_n)
    x = torch.randn(m, k).to(dtype)
    out = on_device(fp8_matmul, x, weight, scales, group_k, group_n, backend="triton", path=path)
    ref = fp8_reference(x, weight, scales, group_k, group_n)
    assert out.shape == (m, n) and out.dtype == dtype
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= TOLERANCE[dtype], f"{path}: max error {error:.3g} of the output scale"


def test_router_by_rows():
    assert pick_path(1) == pick_path(GEMV_MAX_M) == "gemv"
    assert pick_path(GEMV_MAX_M + 1) == pick_path(DEQUANT_MIN_M - 1) == "gemm"
    assert pick_path(DEQUANT_MIN_M) == "dequant"


def test_k_tiles_never_span_two_groups():
    assert _block_k(4096, 128) == 64 and _block_k(200, 200) == 64 and _block_k(96, 32) == 32
    with pytest.raises(ValueError, match="not a multiple of 16"):
        _block_k(96, 24)


def test_custom_op_traces_without_graph_breaks():
    from hfaccel.kernels.ops import fp8_matmul_op

    weight, scales = (t.to(DEVICE) for t in _weights(192, 136, 64, 64))
    x = torch.randn(3, 192, device=DEVICE).half()
    # opcheck's schema test compares the inputs before and after with arithmetic torch has no fp8 CPU kernel for
    torch.library.opcheck(fp8_matmul_op, (x, weight, scales, 64, 64, "auto"),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    fn = torch.compile(lambda x: fp8_matmul_op(x * 2, weight, scales, 64, 64, "auto") + 1, fullgraph=True,
                       backend="aot_eager")
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


# ---- sm_90 compilation ------------------------------------------------------------------------------------------
def _job(dtype, kernel: str, block_m: int, block_k: int):
    ptr = "*" + TRITON_TYPES[dtype]
    ints = ["N", "K", "group_k", "group_n", "stride_xm", "stride_wk", "stride_sk", "stride_om"]
    signature = {name: "i32" for name in ints}
    signature.update(X=ptr, W="*fp8e4nv", S="*fp32", OUT=ptr)
    constexprs = dict(BLOCK_N=64, BLOCK_K=block_k)
    if kernel == "_gemm_kernel":
        signature["M"] = "i32"
        constexprs.update(BLOCK_M=block_m, F32_DOT=dtype == torch.float32)
    return dict(module="hfaccel.kernels.fp8", kernel=kernel, signature=signature, constexprs=constexprs,
                divisible=["X", "W", "S", "OUT", "stride_xm", "stride_wk", "stride_om"], num_warps=4, num_stages=3)


SM90_KERNELS = [(dtype, kernel, block_m, block_k) for dtype in DTYPES for block_k in (64, 32, 16)
                for kernel, block_m in (("_gemv_kernel", 1), ("_gemm_kernel", 16), ("_gemm_kernel", 64))]


@pytest.fixture(scope="module")
def sm90_results():
    return compile_sm90([_job(*case) for case in SM90_KERNELS])


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SM90_KERNELS)))
def test_compiles_for_sm90(index, sm90_results):
    result = sm90_results[index]
    assert result["ok"], f"{SM90_KERNELS[index]}: {result.get('error')}"
    assert result["shared"] <= 227 * 1024
