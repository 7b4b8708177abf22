"""Int4Linear on a CPU without Triton: served by torch's int4 CPU kernel from the same buffers (repacked once,
cached, dropped on a move, a cast or a state-dict load), the torch reference where the kernel cannot take the
weight; a fullgraph torch.compile of it."""

import importlib

import pytest
import torch

from hfaccel.kernels.w4a16 import INT4PACK_GROUP_SIZES
from hfaccel.quant import Int4Linear, Int4Weight, formats, quantize_rtn
from tests.kernels.helpers import INT4PACK_TOLERANCE

linear_module = importlib.import_module("hfaccel.quant.linear")


@pytest.fixture
def no_triton(monkeypatch):
    """A plain CPU: Triton's interpreter off (the suite runs with it on), the routed op path made to fail."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def op_path(*args):
        raise AssertionError("the W4A16 op served a CPU forward the int4 CPU kernel should have")

    monkeypatch.setattr(linear_module, "w4a16_matmul_op", op_path)


def _rtn_module(
    k: int, n: int, group_size: int, dtype=torch.float32, seed: int = 0
) -> tuple[Int4Linear, Int4Weight, torch.Tensor]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=True)
    weight = quantize_rtn(linear.weight, group_size)
    return Int4Linear.from_weight(weight, linear.bias, dtype=dtype), weight, linear.bias


def _assert_close_to(out: torch.Tensor, expected: torch.Tensor) -> None:
    error = (out.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert error <= INT4PACK_TOLERANCE, f"max error {error:.3g} of the output scale"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group_size", INT4PACK_GROUP_SIZES)
def test_cpu_kernel_serves_rtn_weights(no_triton, group_size, dtype):
    """Every group size the kernel takes, N = 200 (padded to 208 inside), leading dims kept; the dequantized
    Linear within bf16's tolerance, through the kernel (the op path raises)."""
    module, weight, bias = _rtn_module(512, 200, group_size, dtype)
    x = torch.randn(2, 3, 512).to(dtype)
    out = module(x)
    assert out.shape == (2, 3, 200) and out.dtype == dtype
    assert module.cpu_path.startswith("int4pack") and "cpu_path=int4pack" in repr(module)
    _assert_close_to(out, x.float() @ weight.dequantize().t() + bias)


def test_cpu_kernel_serves_gptq_act_order(no_triton):
    """A GPTQ act-order checkpoint: the input permutation, then the kernel on the same packed words."""
    k, n, group_size = 256, 72, 64
    gen = torch.Generator().manual_seed(3)
    g_idx = (torch.arange(k, dtype=torch.int32) // group_size)[torch.randperm(k, generator=gen)]
    tensors = formats.to_gptq(
        formats.Int4Weight.from_values(
            torch.randint(0, 16, (k, n), dtype=torch.int32, generator=gen),
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
    module = Int4Linear.from_weight(weight, dtype=torch.float32)
    x = torch.randn(5, k)
    _assert_close_to(module(x), x @ weight.dequantize().t())
    assert module.cpu_path.startswith("int4pack")


def test_pack_is_built_once_and_dropped_when_stale(no_triton, monkeypatch):
    module, weight, bias = _rtn_module(256, 64, 64)
    x = torch.randn(4, 256)
    first = module(x)
    pack = module.cpu_pack()
    module(x)
    assert pack is not None and module.cpu_pack() is pack  # built once
    module.to("cpu")
    assert module.cpu_path is None and module._int4pack is None  # moved: rebuilt on the next forward
    torch.testing.assert_close(module(x), first, atol=0, rtol=0)
    other, other_weight, other_bias = _rtn_module(256, 64, 64, seed=1)
    module.load_state_dict(other.state_dict())
    assert module.cpu_path is None
    _assert_close_to(module(x), x @ other_weight.dequantize().t() + other_bias)
    module.to(torch.bfloat16)
    assert module.cpu_path is None
    assert module(x.bfloat16()).dtype == torch.bfloat16 and module.cpu_pack().scales_and_zeros.dtype == torch.bfloat16


def test_unsupported_group_size_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    module, weight, bias = _rtn_module(96, 64, 16)
    x = torch.randn(3, 96)
    with pytest.warns(UserWarning, match="slow torch reference: group_size 16 is not one of"):
        out = module(x)
    assert module.cpu_path.startswith("torch reference") and module.cpu_pack() is None
    torch.testing.assert_close(out, x @ weight.dequantize().t() + bias, atol=1e-5, rtol=1e-5)


def test_fullgraph_compile_uses_the_pack(no_triton):
    module, weight, bias = _rtn_module(256, 96, 64)
    x = torch.randn(3, 256)
    eager = module(x)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), eager, atol=0, rtol=0)


def test_accelerate_packs_int4_layers_and_says_what_serves_them(no_triton):
    """``accelerate(quantize="rtn")`` on a plain CPU: every Int4Linear packed at accelerate time (before any
    forward, so a compiled first call finds the packs), ``model.hfaccel`` naming the path; generate() tokens equal
    those of the same quantized model whose layers compute through the kernel without being accelerated."""
    import hfaccel
    from tests.models import padded_batch
    from tests.helpers import quant_llama

    reference = hfaccel.quantize(quant_llama(), "rtn", group_size=64)
    batch = padded_batch()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = reference.generate(**batch, **kwargs)
    model = hfaccel.accelerate(quant_llama(), quantize="rtn", group_size=64)
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 14 and all(layer.cpu_path.startswith("int4pack") for layer in layers)
    assert "int4 layers: 14 × int4pack" in str(model.hfaccel)
    assert torch.equal(model.generate(**batch, **kwargs), expected)
