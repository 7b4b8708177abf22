"""w4a16_matmul (Triton, interpreted) vs w4a16_reference on every path the router can pick (GEMV, split-K and
full GEMMs, dequantize + cuBLAS); torch's CPU int4 kernel on the repacked weight; the router; sm_90 compilation of
every configuration it can pick."""

import json

import pytest
import torch

from hfaccel.kernels import tuning
from hfaccel.kernels.split_k import SUM_BLOCK
from hfaccel.kernels.w4a16 import (
    INT4PACK_DTYPE,
    dequantize,
    dequantize_weight,
    int4pack_matmul,
    int4pack_scales_and_zeros,
    int4pack_unsupported,
    pack_int4_cpu,
    w4a16_matmul,
    w4a16_reference,
)
from hfaccel.kernels.w4a16_config import (
    DEQUANT_MIN_M,
    M_BUCKETS,
    W4A16Config,
    candidate_configs,
    fit_config,
    heuristic_config,
    pick_w4a16_config,
    table_key,
)
from tests.devices import DEVICE, on_device
from tests.kernels.helpers import INT4PACK_TOLERANCE, TRITON_TYPES, assert_each_compiles_for_sm90

# (atol, rtol) relative to the output's scale: the GEMM and dequant paths round the dequantized weight to the
# activation dtype before the tensor-core dot (fp16: 2^-11 relative per weight, bf16: 2^-8), the reference does
# not; over K terms the errors add like a random walk, so compare against max|reference| with these factors.
# (The GEMV and the small-M GEMM multiply exact q - z and scale the sums: only the output rounding remains.)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (K, N, group size): N never a power of two; K-tiles of 128, 64 and 32 rows (one group each).
SHAPES = [(384, 320, 128), (192, 200, 64), (160, 136, 32)]


def _weights(k, n, group_size, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).to(dtype)
    return qweight, scales, zeros


def _assert_matches_reference(m, k, n, group_size, dtype, config=None):
    qweight, scales, zeros = _weights(k, n, group_size, dtype)
    x = torch.randn(m, k).to(dtype)
    out = on_device(w4a16_matmul, x, qweight, scales, zeros, group_size, backend="triton", config=config)
    ref = w4a16_reference(x, qweight, scales, zeros, group_size)
    assert out.shape == (m, n) and out.dtype == dtype
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= TOLERANCE[dtype], f"{config}: max error {error:.3g} of the output scale"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 16, 33, 128, 300])
@pytest.mark.parametrize("k, n, group_size", SHAPES)
def test_routed_call_matches_reference(m, k, n, group_size, dtype):
    _assert_matches_reference(m, k, n, group_size, dtype)


# Every path and variant a table entry can select: GEMV (1 to 8 columns per thread, split or not), GEMM with the
# scale after the dot (block_m < block_k) or folded into the weights, split or not, and dequantize + cuBLAS.
FORCED = [
    W4A16Config("gemv", 1, 128, 128, split_k=1, num_warps=1, num_stages=1),
    W4A16Config("gemv", 1, 256, 64, split_k=2, num_warps=1, num_stages=1),
    W4A16Config("gemv", 1, 512, 128, split_k=4, num_warps=4, num_stages=1),
    W4A16Config("gemm", 16, 64, 128, split_k=2, num_warps=4, num_stages=4),
    W4A16Config("gemm", 32, 128, 64, split_k=1, num_warps=4, num_stages=4),
    W4A16Config("gemm", 64, 64, 64, split_k=4, num_warps=4, num_stages=4),
    W4A16Config("gemm", 128, 128, 64, split_k=2, num_warps=8, num_stages=3),
    W4A16Config("dequant", block_n=128, block_k=64),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", FORCED, ids=str)
@pytest.mark.parametrize("m, k, n, group_size", [(3, 384, 200, 128), (17, 192, 136, 64)])
def test_every_path_matches_reference(m, k, n, group_size, dtype, config):
    _assert_matches_reference(m, k, n, group_size, dtype, config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_kernel_rounds_each_weight_once(dtype):
    qweight, scales, zeros = _weights(192, 200, 64, dtype)
    w = on_device(dequantize_weight, qweight, scales, zeros, 64, dtype)
    exact = dequantize(qweight, scales, zeros, 64)
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":  # the interpreter truncates fp32 -> bf16: within a step
        torch.testing.assert_close(w.float(), exact, atol=0, rtol=2**-7)
    else:
        assert torch.equal(w, exact.to(dtype))


@pytest.mark.parametrize("act_order", [False, True], ids=["groups-in-order", "act-order"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_int4_linear_runs_gptq_checkpoints(m, act_order):
    """An Int4Linear from GPTQ tensors (act-order: the input permutation applied before the kernel) equals the
    dequantized Linear, through the routed Triton kernels."""
    from hfaccel.quant import Int4Linear, formats

    k, n, group_size = 256, 72, 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (k, n), dtype=torch.int32, generator=gen)
    g_idx = torch.arange(k, dtype=torch.int32) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    tensors = formats.to_gptq(
        formats.Int4Weight.from_values(
            q,
            torch.rand(k // group_size, n, generator=gen).half() * 0.02 + 0.01,
            torch.randint(0, 16, (k // group_size, n), generator=gen).half(),
            group_size,
            g_idx,
        ),
        v1=False,
    )
    weight = formats.from_gptq(
        tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], group_size, v1=False
    )
    assert (weight.perm is not None) == act_order
    module = Int4Linear.from_weight(weight, dtype=torch.float32).to(DEVICE)
    x = torch.randn(m, k, device=DEVICE)
    torch.testing.assert_close(module(x), x @ weight.dequantize().t().to(DEVICE), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 3, 33])
@pytest.mark.parametrize("k, n, group_size", SHAPES + [(512, 72, 256)])
def test_int4pack_matches_reference(m, k, n, group_size, dtype):
    """The repacked weight through aten._weight_int4pack_mm_for_cpu (N padded to 16 where it is not: 200, 136, 72),
    from a non-contiguous x."""
    qweight, scales, zeros = _weights(k, n, group_size, dtype)
    x = torch.randn(k, m).to(dtype).t()  # [M, K], a transposed view
    out = int4pack_matmul(x, pack_int4_cpu(qweight, scales, zeros, group_size))
    ref = w4a16_reference(x, qweight, scales, zeros, group_size)
    assert out.shape == (m, n) and out.dtype == dtype
    error = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert error <= INT4PACK_TOLERANCE, f"max error {error:.3g} of the output scale"


def test_int4pack_zero_point_convention():
    """The CPU kernel's ``W = (q - 8) * scale + zero`` with ``zero = (8 - z) * s`` is hfaccel's ``(q - z) * s``:
    multiplying the identity reads the kernel's dequantized weight back, exactly where every value is a bf16
    (scales powers of two, every code 0..15 against every zero point 0..15)."""
    from hfaccel.quant.formats import pack_along_rows

    k, n, group_size = 64, 256, 32
    codes = (torch.arange(k)[:, None] + torch.arange(n)[None]) % 16  # [K, N]: every code in each group's column
    zeros = (torch.arange(n) // 16).float().expand(k // group_size, n)  # [K/g, N]: every zero point
    scales = 2.0 ** -torch.randint(2, 9, (k // group_size, n), generator=torch.Generator().manual_seed(0)).float()
    qweight = pack_along_rows(codes.to(torch.int32))  # [K/8, N]
    pairs = int4pack_scales_and_zeros(scales, zeros)
    assert pairs.shape == (k // group_size, n, 2) and pairs.dtype == INT4PACK_DTYPE
    assert torch.equal(pairs[..., 1].float(), (8 - zeros) * scales)
    read_back = int4pack_matmul(torch.eye(k), pack_int4_cpu(qweight, scales, zeros, group_size))  # [K, N]
    assert torch.equal(read_back, dequantize(qweight, scales, zeros, group_size))


def test_int4pack_group_sizes():
    assert all(int4pack_unsupported(g) is None for g in (32, 64, 128, 256))
    assert "group_size 16 is not one of" in int4pack_unsupported(16)
    qweight, scales, zeros = _weights(96, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="cannot take this weight: group_size 16"):
        pack_int4_cpu(qweight, scales, zeros, 16)


def test_custom_op_traces_without_graph_breaks():
    """torch.ops.hfaccel.w4a16_matmul: schema and fake implementation agree (opcheck), and a fullgraph trace of a
    function calling it runs the routed kernel."""
    from hfaccel.kernels.ops import w4a16_matmul_op

    qweight, scales, zeros = (t.to(DEVICE) for t in _weights(192, 200, 64, torch.float16))
    x = torch.randn(3, 192, device=DEVICE).half()
    torch.library.opcheck(w4a16_matmul_op, (x, qweight, scales, zeros, 64, "auto"))
    fn = torch.compile(
        lambda x: w4a16_matmul_op(x * 2, qweight, scales, zeros, 64, "auto") + 1, fullgraph=True, backend="aot_eager"
    )
    expected = w4a16_reference(x * 2, qweight, scales, zeros, 64) + 1
    error = (fn(x).float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= TOLERANCE[torch.float16]


def test_splits_k_while_tiles_leave_sms_idle():
    """Decode-sized M splits K (each split's partial summed in split order); tiles that fill the GPU do not."""
    assert pick_w4a16_config(1, 4096, 4096, torch.float16, 128).split_k > 1
    assert pick_w4a16_config(16, 4096, 4096, torch.float16, 128).split_k > 1
    assert pick_w4a16_config(512, 14336, 4096, torch.float16, 128).split_k == 1
    assert pick_w4a16_config(1, 128256, 4096, torch.float16, 128).split_k == 1  # the LM head fills the GPU alone


def test_heuristics_route_by_m():
    paths = {m: heuristic_config(m, 4096, 4096, torch.float16, 128).path for m in (1, 2, 16, 64, 512, DEQUANT_MIN_M)}
    assert paths == {1: "gemv", 2: "gemm", 16: "gemm", 64: "gemm", 512: "gemm", DEQUANT_MIN_M: "dequant"}
    small_groups = {m: heuristic_config(m, 4096, 4096, torch.float16, 8).path for m in (1, 16, 17)}
    assert small_groups == {1: "gemv", 16: "gemv", 17: "dequant"}  # no tensor-core K-tile fits a group of 8


def test_configs_are_validated_and_fitted():
    with pytest.raises(ValueError, match="path must be one of"):
        W4A16Config("marlin")
    with pytest.raises(ValueError, match="power of two"):
        W4A16Config("gemv", block_n=100)
    with pytest.raises(ValueError, match="unknown field"):
        W4A16Config.from_entry({"path": "gemv", "block_x": 1})
    fitted = fit_config(W4A16Config("gemv", block_k=128, split_k=64), 1, 256, 512, 32)
    assert (fitted.block_k, fitted.split_k) == (32, 16)  # a K-tile inside a group; no more splits than tiles
    with pytest.raises(ValueError, match="inside one group"):
        fit_config(W4A16Config("gemm", block_k=64), 16, 256, 512, 8)


def test_every_candidate_is_valid_for_its_shape():
    for m in M_BUCKETS:
        for k, n, group_size in SHAPES + [(4096, 4096, 128), (14336, 4096, 128)]:
            candidates = candidate_configs(m, n, k, torch.float16, group_size)
            assert candidates and len(set(candidates)) == len(candidates)
            assert all(fit_config(c, m, n, k, group_size) == c for c in candidates)
            assert heuristic_config(m, n, k, torch.float16, group_size).path in {c.path for c in candidates}


def test_router_follows_the_table_deterministically(gpu_table):
    tuned = W4A16Config("gemm", 16, 128, 64, split_k=4, num_warps=4, num_stages=4)
    gemv = W4A16Config("gemv", 1, 512, 128, split_k=8, num_warps=2, num_stages=1)
    gpu_table.write_text(
        json.dumps(
            {
                "gpu": "NVIDIA Test GPU 80GB",
                "ops": {
                    "w4a16": {
                        table_key(4, 4096, 4096, torch.float16, 128): {**tuned.entry(), "us": 7.5},
                        table_key(1, 4096, 4096, torch.float16, 128): {**gemv.entry(), "us": 3.25},
                    }
                },
            }
        )
    )
    picks = [pick_w4a16_config(m, 4096, 4096, torch.float16, 128, "cuda") for m in (3, 4, 3, 1, 4)]
    assert picks == [tuned, tuned, tuned, gemv, tuned]  # M = 3 and 4 share the bucket m4
    for m in (2, 8):  # M buckets not in the table: a measured one next to them (2: m1 and m4 tie, the larger)
        assert pick_w4a16_config(m, 4096, 4096, torch.float16, 128, "cuda") == fit_config(tuned, m, 4096, 4096, 128)
    assert pick_w4a16_config(64, 4096, 4096, torch.float16, 128, "cuda") == heuristic_config(
        64, 4096, 4096, torch.float16, 128
    )  # 16x from the nearest measured M
    assert pick_w4a16_config(4, 4096, 4096, torch.bfloat16, 128, "cuda") == heuristic_config(
        4, 4096, 4096, torch.bfloat16, 128
    )  # no entry of its dtype


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no tuned kernel table"),
        ("{not json", "unreadable"),
        ('{"ops": {"w4a16": []}}', "unreadable"),
        (
            json.dumps({"ops": {"w4a16": {table_key(16, 4096, 4096, torch.float16, 128): {"path": "marlin"}}}}),
            "unusable",
        ),
        (
            json.dumps(
                {"ops": {"w4a16": {table_key(16, 4096, 4096, torch.float16, 128): {"path": "gemv", "tile": 3}}}}
            ),
            "unusable",
        ),
        (
            json.dumps(
                {"ops": {"w4a16": {table_key(16, 4096, 4096, torch.float16, 128): {"path": "gemm", "block_k": 8}}}}
            ),
            "unusable",
        ),
    ],
)
def test_missing_or_corrupt_table_means_heuristics_with_a_warning(gpu_table, content, message):
    if content is not None:
        gpu_table.write_text(content)
    with pytest.warns(UserWarning, match=message):
        config = pick_w4a16_config(16, 4096, 4096, torch.float16, 128, "cuda")
    assert config == heuristic_config(16, 4096, 4096, torch.float16, 128)


def test_bad_inputs():
    qweight, scales, zeros = _weights(256, 64, 128, torch.float16)
    x = torch.randn(2, 256).half()
    with pytest.raises(ValueError, match="qweight must be int32"):
        w4a16_matmul(torch.randn(2, 128).half(), qweight, scales, zeros, 128)
    with pytest.raises(ValueError, match="scales must be"):
        w4a16_matmul(x, qweight, scales.float(), zeros, 128)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_matmul(x, qweight, scales, zeros, 96)


# ---- sm_90 compilation: every configuration the router can pick ------------------------------------------------
def _kernel_job(dtype, cfg: W4A16Config, split: bool):
    """A compile job for the kernel that serves ``cfg`` (``split``: its fp32-partials variant)."""
    ptr = "*" + TRITON_TYPES[dtype]
    ints = [
        "group_size",
        "k_per_split",
        "stride_xm",
        "stride_qk",
        "stride_sg",
        "stride_zg",
        "stride_os",
        "stride_om",
        "N",
        "K",
    ]
    signature = {name: "i32" for name in ints + ["M"]}
    signature.update(X=ptr, QW="*i32", SCALES=ptr, ZEROS=ptr, OUT="*fp32" if split else ptr)
    constexprs = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split)
    if cfg.path == "gemv":
        kernel = "_gemv_kernel"
        del signature["M"]
    else:
        kernel = "_gemm_kernel"
        constexprs.update(BLOCK_M=cfg.block_m, SCALE_AFTER=cfg.block_m < cfg.block_k, F32_DOT=dtype == torch.float32)
    return dict(
        module="hfaccel.kernels.w4a16",
        kernel=kernel,
        signature=signature,
        constexprs=constexprs,
        divisible=["X", "QW", "SCALES", "ZEROS", "OUT"] + ints,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        ptx_patterns=["ld.global.v4", "cvt.rn.f32.s32", "cvt.rn.f32.u32"],
    )


def _side_jobs(dtype):
    ptr = "*" + TRITON_TYPES[dtype]
    return [
        dict(
            module="hfaccel.kernels.w4a16",
            kernel="_dequantize_kernel",
            signature=dict(
                QW="*i32",
                SCALES=ptr,
                ZEROS=ptr,
                W=ptr,
                N="i32",
                group_size="i32",
                stride_qk="i32",
                stride_sg="i32",
                stride_zg="i32",
                stride_wk="i32",
            ),
            constexprs=dict(BLOCK_N=128, BLOCK_K=64),
            num_warps=4,
            num_stages=1,
        ),
        dict(
            module="hfaccel.kernels.split_k",
            kernel="_sum_splits_kernel",
            signature=dict(PARTIAL="*fp32", OUT=ptr, numel="i32", splits="i32"),
            constexprs=dict(BLOCK=SUM_BLOCK),
            num_warps=4,
            num_stages=1,
        ),
    ]


def _tuned_entries():
    """(dtype, config) of every w4a16 entry in the tables shipped under hfaccel/kernels/configs/."""
    found = []
    for path in sorted(tuning.CONFIG_DIR.glob("*.json")):
        for key, entry in json.loads(path.read_text())["ops"].get("w4a16", {}).items():
            found.append((getattr(torch, key.rsplit("_dtype", 1)[1]), W4A16Config.from_entry(entry)))
    return found


def _sm90_configs():
    """(dtype, path, tiles..., split) of the kernels to compile: the tuner's search space in fp16, the heuristics'
    picks in every dtype (group size 128: smaller groups only shrink K-tiles), and every shipped tuned entry."""
    picked = set()
    for m in M_BUCKETS:
        for n, k in ((4096, 4096), (1024, 4096), (4096, 14336), (128256, 4096)):
            picked.update((torch.float16, c) for c in candidate_configs(m, n, k, torch.float16, 128))
            picked.update((dtype, heuristic_config(m, n, k, dtype, 128)) for dtype in DTYPES)
    picked.update(_tuned_entries())
    kernels = {
        (
            dtype,
            c.path,
            c.block_m if c.path == "gemm" else 1,
            c.block_n,
            c.block_k,
            c.num_warps,
            c.num_stages,
            c.split_k > 1,
        )
        for dtype, c in picked
        if c.path != "dequant"
    }
    return sorted(kernels, key=str)


SM90_KERNELS = _sm90_configs()
SM90_DTYPES = DTYPES


@pytest.mark.slow
def test_compiles_for_sm90():
    def check(case, result):
        assert result["shared"] <= 227 * 1024
        counts = result["ptx_counts"]
        assert counts.get("cvt.rn.f32.s32", 0) + counts.get("cvt.rn.f32.u32", 0) == 0, (
            "int->float conversions in the dequantization"
        )
        if case in SM90_KERNELS and case[1] == "gemv":
            assert counts["ld.global.v4"] > 0 and result["shared"] == 0, (
                "the GEMV must stream 128-bit loads and keep its sums in registers"
            )

    jobs = [
        _kernel_job(dtype, W4A16Config(path, block_m, block_n, block_k, 1, warps, stages), split)
        for dtype, path, block_m, block_n, block_k, warps, stages, split in SM90_KERNELS
    ]
    side_jobs = [job for dtype in SM90_DTYPES for job in _side_jobs(dtype)]
    cases = SM90_KERNELS + [f"{job['kernel']} (dequantize / sum-splits)" for job in side_jobs]
    assert_each_compiles_for_sm90(cases, jobs + side_jobs, check)
