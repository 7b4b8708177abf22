"""w4a16_matmul (Triton, interpreted) vs w4a16_reference; GEMM and split-K GEMV paths; sm_90 compilation."""

import importlib

import pytest
import torch

from hfaccel.kernels.w4a16 import pick_w4a16_config, w4a16_matmul, w4a16_reference
from tests.devices import on_device
from tests.kernels.helpers import TRITON_TYPES, compile_sm90

w4a16_module = importlib.import_module("hfaccel.kernels.w4a16")
# (atol, rtol) relative to the output's scale: the kernel rounds the dequantized weight to the activation
# dtype before the tensor-core dot (fp16: 2^-11 relative per weight, bf16: 2^-8), the reference does not;
# over K terms the errors add like a random walk, so compare against max|reference| with these factors.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _weights(k, n, group_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).to(dtype)
    return qweight, scales, zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 33, 128])
@pytest.mark.parametrize("k, n, group_size", [(384, 320, 128), (192, 200, 64)])
def test_matches_reference(m, k, n, group_size, dtype):
    qweight, scales, zeros = _weights(k, n, group_size, dtype)
    x = torch.randn(m, k).to(dtype)
    out = on_device(w4a16_matmul, x, qweight, scales, zeros, group_size, backend="triton")
    ref = w4a16_reference(x, qweight, scales, zeros, group_size)
    assert out.shape == (m, n) and out.dtype == dtype
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= TOLERANCE[dtype], f"max error {error:.3g} of the output scale"


def test_gemv_splits_k_and_gemm_does_not():
    assert pick_w4a16_config(1, 4096, 4096, torch.float16)[4] > 1
    assert pick_w4a16_config(16, 4096, 4096, torch.float16)[4] > 1
    assert pick_w4a16_config(17, 4096, 4096, torch.float16)[4] == 1


def test_bad_inputs():
    qweight, scales, zeros = _weights(256, 64, 128, torch.float16)
    x = torch.randn(2, 256).half()
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_matmul(torch.randn(2, 128).half(), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_matmul(x, qweight, scales.float(), zeros, 128)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, qweight, scales, zeros, 96)


SM90_CASES = [(dtype, m) for dtype in (torch.float16, torch.bfloat16, torch.float32) for m in (1, 64, 128)]


@pytest.fixture(scope="module")
def sm90_results():
    kernel = w4a16_module._w4a16_kernel
    jobs = []
    for dtype, m in SM90_CASES:
        block_m, block_n, block_k, num_warps, _ = pick_w4a16_config(m, 4096, 4096, dtype)
        signature = {name: "i32" for name in kernel.arg_names if not name.startswith("BLOCK_")
                     and name not in ("UPCAST", "IEEE_FP32")}
        ptr = "*" + TRITON_TYPES[dtype]
        signature.update(X=ptr, QW="*i32", SCALES=ptr, ZEROS=ptr, OUT="*fp32")
        jobs.append(dict(module="hfaccel.kernels.w4a16", kernel="_w4a16_kernel", signature=signature,
                         constexprs=dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, 128), UPCAST=False,
                                         IEEE_FP32=dtype == torch.float32), num_warps=num_warps, num_stages=3))
    return compile_sm90(jobs)


@pytest.mark.parametrize("index", range(len(SM90_CASES)))
def test_compiles_for_sm90(index, sm90_results):
    result = sm90_results[index]
    assert result["ok"], f"{SM90_CASES[index]}: {result.get('error')}"
    assert result["shared"] <= 227 * 1024
