"""``Fp8Linear``: an ``nn.Linear`` replacement holding float8 (e4m3) weights and their scales, running the fp8
kernels (``hfaccel.kernels.fp8``: the weight's bytes halved, the math 16-bit).

Scales are kept as the checkpoint gives them, in one block layout: ``weight_scale [ceil(K / group_k),
ceil(N / group_n)]`` — per output channel (``group_k = K, group_n = 1``), per 128×128 block, or per tensor.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch import nn

from hfaccel.device import model_device
from hfaccel.kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize, fp8_kernels_run
from hfaccel.kernels.ops import fp8_matmul_op


def row_amax(weight: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each row of ``weight [N, K]``, fp32 ``[N]``."""
    return weight.detach().to(torch.float32).abs().amax(dim=1)


def quantize_rows(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` per output channel: each row scaled so that its largest magnitude (``amax [N]``, by default
    the row's own: a rowwise shard passes the whole row's) is e4m3's largest value (448), rounded to the nearest e4m3;
    (fp8 ``[N, K]``, fp32 scales ``[N, 1]``)."""
    amax = row_amax(weight) if amax is None else amax
    scale = amax.clamp(min=1e-12) / FP8_MAX  # [N]
    quantized = (weight.detach().to(torch.float32) / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale[:, None]


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W[n, k] = weight[k, n] * weight_scale[k // group_k, n // group_n]``.

    Buffers: ``weight [K, N]`` float8_e4m3fn (the transpose of ``nn.Linear.weight``), ``weight_scale`` fp32 (module
    docstring); ``bias [N]`` in the activation dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_k: int | None = None,
        group_n: int = 1,
        bias: bool = False,
        dtype: torch.dtype = torch.bfloat16,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group_k, self.group_n = group_k or in_features, group_n
        groups = (-(-in_features // self.group_k), -(-out_features // group_n))
        self.register_buffer("weight", torch.zeros(in_features, out_features, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(groups, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.register_buffer("dense", None, persistent=False)  # [N, K]: the weight dequantized once, where no fp8
        # kernel runs

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """``linear`` quantized per output channel (:func:`quantize_rows`)."""
        quantized, scale = quantize_rows(linear.weight.detach())
        return cls.from_checkpoint(quantized, scale, None, linear.bias, dtype=linear.weight.dtype)

    @classmethod
    def from_checkpoint(
        cls,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int] | None,
        bias: torch.Tensor | None = None,
        *,
        dtype: torch.dtype = torch.bfloat16,
    ) -> Fp8Linear:
        """A layer of a checkpoint's fp8 ``weight [N, K]`` and its scales as the formats store them: ``scale``
        ``[N, 1]`` or ``[N]`` per output channel, ``[1]`` / ``[]`` per tensor, or ``[ceil(N / bn), ceil(K / bk)]``
        per ``block = (bn, bk)`` (block FP8's ``weight_scale_inv``)."""
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(
                f"an fp8 checkpoint weight is a 2-D {FP8_DTYPE} tensor; got {weight.dtype} {list(weight.shape)}"
            )
        n, k = weight.shape
        scale = scale.to(torch.float32)
        if block is not None:
            group_n, group_k = block
            layout = scale.t()  # [ceil(K / bk), ceil(N / bn)]
        elif scale.numel() == 1:
            group_n, group_k, layout = n, k, scale.reshape(1, 1)
        elif scale.numel() == n:
            group_n, group_k, layout = 1, k, scale.reshape(1, n)
        else:
            raise ValueError(
                f"fp8 scales of shape {list(scale.shape)} fit neither per-channel ([{n}, 1]) nor "
                f"per-tensor scales of a [{n}, {k}] weight, and no weight_block_size was given"
            )
        module = cls(k, n, group_k=group_k, group_n=group_n, bias=bias is not None, dtype=dtype, device=weight.device)
        if tuple(layout.shape) != tuple(module.weight_scale.shape):
            raise ValueError(
                f"fp8 block scales {list(scale.shape)} do not fit a [{n}, {k}] weight in blocks of {block}"
            )
        module.weight.copy_(weight.t())
        module.weight_scale.copy_(layout)
        if bias is not None:
            module.bias.data.copy_(bias.to(dtype))
        return module

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[N, K]`` (``nn.Linear``'s layout) in ``dtype``."""
        return dequantize(self.weight, self.weight_scale, self.group_k, self.group_n, dtype).t()

    @property
    def granularity(self) -> str:
        """How the scales are laid out: "per channel", "per tensor" or "blocks of BN x BK"."""
        if self.group_n == 1 and self.group_k >= self.in_features:
            return "per channel"
        if self.group_n >= self.out_features and self.group_k >= self.in_features:
            return "per tensor"
        return f"blocks of {self.group_n}x{self.group_k}"

    def dequantize_once(self, dtype: torch.dtype) -> None:
        """Serve the layer by a dense matmul of its weight dequantized now to ``dtype`` (on a GPU without the fp8
        kernels: :func:`dense_where_no_fp8_kernels`); the fp8 weight stays (for saving, and the kernels elsewhere)."""
        self.dense = self.dequantized(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] @ W.T`` -> ``[..., N]``, without the bias."""
        if self.dense is not None:
            return nn.functional.linear(x, self.dense)
        flat = x.reshape(-1, self.in_features)
        out = fp8_matmul_op(flat, self.weight, self.weight_scale, self.group_k, self.group_n, "auto")
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        out = self.matmul(x)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 {self.granularity}, "
            f"bias={self.bias is not None}"
        )


# transformers' own fp8 layers (on a GPU; on a CPU transformers dequantizes such checkpoints to 16-bit Linear layers)
# and the attribute holding their scales: FineGrainedFP8 (block FP8), FBGEMM fp8
TRANSFORMERS_FP8_LAYERS = {"FP8Linear": "weight_scale_inv", "FbgemmFp8Linear": "weight_scale"}


def from_transformers_layer(module: nn.Module, dtype: torch.dtype) -> Fp8Linear | None:
    """An :class:`Fp8Linear` of an fp8 layer as transformers loads one (its weight and scales as they are,
    ``dtype`` the activations'): FineGrainedFP8's or FBGEMM's layers, or an ``nn.Linear`` that compressed-tensors
    quantized (fp8 ``weight``, ``weight_scale``, its ``quantization_scheme``); None for any other module."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE:
        return None
    scale_name = TRANSFORMERS_FP8_LAYERS.get(type(module).__name__)
    if scale_name is not None and type(module).__module__.startswith("transformers.integrations"):
        block = getattr(module, "block_size", None)
        block = None if block is None else tuple(block)
    elif type(module) is nn.Linear and hasattr(module, "quantization_scheme") and hasattr(module, "weight_scale"):
        scale_name, block = "weight_scale", compressed_tensors_block([module.quantization_scheme.weights.model_dump()])
    else:
        return None
    return Fp8Linear.from_checkpoint(
        weight.detach(), getattr(module, scale_name).detach(), block, module.bias, dtype=dtype
    )


def compressed_tensors_block(weights: list[dict]) -> tuple[int, int] | None:
    """The weight blocks of compressed-tensors fp8 weight schemes (their ``weights`` arguments, as dicts): None per
    channel or per tensor (read off the scales' shape), ``(bn, bk)`` for one block structure; a ValueError for any
    other scheme."""
    if not weights or any(w.get("type") != "float" or w.get("num_bits") != 8 for w in weights):
        raise ValueError(f"hfaccel reads compressed-tensors fp8 weights (8-bit float); got {weights}")
    strategies = {str(w.get("strategy")) for w in weights}
    if strategies <= {"channel", "tensor"}:
        return None
    if strategies == {"block"}:
        blocks = {tuple(w.get("block_structure") or ()) for w in weights}
        if len(blocks) == 1 and len(next(iter(blocks))) == 2:
            return tuple(int(b) for b in blocks.pop())
    raise ValueError(
        f"compressed-tensors fp8 weight strategies {sorted(strategies)}: hfaccel reads channel, tensor "
        "and block (one block structure)"
    )


def fp8_targets(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> list[tuple[str, nn.Linear]]:
    """(name, layer) of the Linear layers ``quantize(method="fp8")`` turns into :class:`Fp8Linear`: all but
    ``skip``."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear and not any(name == s or name.endswith("." + s) for s in skip)
    ]


def adopt_fp8_layers(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, nn.Module]]:
    """Replace transformers' fp8 layers in ``model`` by :class:`Fp8Linear` ones; returns ``(name, the original
    layer)`` of each, for :func:`put_back`."""
    replaced = []
    for name, module in list(model.named_modules()):
        ours = from_transformers_layer(module, dtype)
        if ours is not None:
            _set(model, name, ours)
            replaced.append((name, module))
    return replaced


def put_back(model: nn.Module, replaced: list[tuple[str, nn.Module]]) -> None:
    """Undo :func:`adopt_fp8_layers`: the original layers back where they were."""
    for name, module in replaced:
        _set(model, name, module)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def fp8_layers(model: nn.Module) -> tuple[Fp8Linear, ...]:
    """The :class:`Fp8Linear` layers of ``model``, in module order."""
    return tuple(m for m in model.modules() if isinstance(m, Fp8Linear))


def fp8_summary(layers: tuple[Fp8Linear, ...]) -> str:
    """``"14 × fp8 e4m3 per channel"``-style summary of ``layers`` (and where they are served dequantized)."""
    counts = Counter(layer.granularity for layer in layers)
    summary = ", ".join(f"{n} × fp8 e4m3 {granularity}" for granularity, n in counts.items())
    dense = {layer.dense.dtype for layer in layers if layer.dense is not None}
    return summary + (f", dequantized to {', '.join(map(str, dense))} (no fp8 kernel on this device)" if dense else "")


def check_fp8_backend(model: nn.Module, backend: str, quantize: str | None) -> None:
    """A ``ValueError`` when ``backend="triton"`` demands hfaccel's kernels for fp8 weights (the model's, or
    ``quantize="fp8"``'s) on a device where the fp8 kernels do not run."""
    device = model_device(model)
    has_fp8 = quantize == "fp8" or any(
        isinstance(w := getattr(m, "weight", None), torch.Tensor) and w.dtype == FP8_DTYPE for m in model.modules()
    )
    if backend == "triton" and has_fp8 and not fp8_kernels_run(device):
        raise ValueError(
            f"attention='triton' demands hfaccel's kernels, and its fp8 kernels need a GPU that converts "
            f"e4m3 (sm_89 or later); {device} has none. Use attention='auto' (the fp8 weights then run "
            "dequantized to 16-bit)"
        )


def serves_dequantized(device: torch.device | str) -> bool:
    """Whether fp8 layers on ``device`` run dequantized once: a GPU without e4m3 conversion (below sm_89). The CPU
    runs the kernels under the Triton interpreter, else their torch reference."""
    device = torch.device(device)
    return device.type == "cuda" and not fp8_kernels_run(device)


def dense_where_no_fp8_kernels(model: nn.Module, dtype: torch.dtype) -> int:
    """On a GPU without fp8 kernels (:func:`serves_dequantized`), dequantize each :class:`Fp8Linear` once to ``dtype``,
    with one warning; the number of layers so served."""
    layers = [layer for layer in fp8_layers(model) if serves_dequantized(layer.weight.device)]
    for layer in layers:
        layer.dequantize_once(dtype)
    if layers:
        warnings.warn(
            f"hfaccel: {layers[0].weight.device} has no fp8 conversion (sm_89 or later needed): "
            f"{len(layers)} fp8 layers run dequantized to {dtype}",
            stacklevel=3,
        )
    return len(layers)
