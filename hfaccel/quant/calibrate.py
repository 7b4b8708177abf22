"""Calibrated int4 quantizers, run decoder layer by decoder layer: AWQ and GPTQ.

The calibration tokens run through the embedding once; then each decoder layer in turn (optionally moved to
``calib_device`` just for its turn, so a model larger than one device can be calibrated) sees the hidden
states the already-quantized layers before it produce, records what its Linear layers receive, is quantized,
and produces the next layer's inputs.

- AWQ (Lin et al. 2024): per group of Linears sharing an input, a per-input-channel scale ``s = mean|x|^α``
  (α searched on a grid) multiplies the weights before rounding and is divided out of the preceding RMSNorm
  or Linear, so the model computes the same function before rounding; α minimises the group's output error.
- GPTQ (Frantar et al. 2023): per set of Linears sharing an input, the Hessian ``H = 2 XᵀX / n`` of that input,
  dampened; columns are rounded in blocks with the rounding error spread over the not-yet-rounded columns through
  the Cholesky factor of ``H⁻¹`` (lazy block updates); optional activation order (columns by decreasing ``H``
  diagonal).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field

import torch
from rich.progress import Progress
from torch import nn

from hfaccel import compat
from hfaccel.quant.formats import Int4Weight
from hfaccel.quant.linear import Int4Linear
from hfaccel.quant.rtn import group_params, quantize_rtn, quantize_values, rtn_round_trip

AWQ_GRID = 20
MAX_SAMPLE_TOKENS = 2048  # activation rows kept per Linear for the AWQ search
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")  # y = weight * normalized(x)


class _Stop(Exception):
    pass


@dataclass
class _Recorder:
    """Inputs one or more Linears received during one layer's calibration pass."""

    samples: list[torch.Tensor] = field(default_factory=list)
    hessian: torch.Tensor | None = None
    count: int = 0

    def add(self, x: torch.Tensor, keep_samples: bool, keep_hessian: bool) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if keep_samples:
            self.samples.append(x)
        if keep_hessian:
            if self.hessian is None:
                self.hessian = torch.zeros(x.shape[1], x.shape[1], device=x.device)
            total = self.count + x.shape[0]
            self.hessian.mul_(self.count / total).add_(x.t() @ x, alpha=2.0 / total)
            self.count = total

    def inputs(self) -> torch.Tensor:
        x = torch.cat(self.samples)
        if x.shape[0] > MAX_SAMPLE_TOKENS:
            x = x[torch.linspace(0, x.shape[0] - 1, MAX_SAMPLE_TOKENS).long()]
        return x

    @classmethod
    def merged(cls, recorders: list[_Recorder]) -> _Recorder:
        """One recorder holding what all of ``recorders`` saw (a Linear called more than once in a pass)."""
        if len(recorders) == 1:
            return recorders[0]
        out = cls(samples=[x for r in recorders for x in r.samples], count=sum(r.count for r in recorders))
        if out.count:
            out.hessian = sum(r.hessian * (r.count / out.count) for r in recorders if r.count)
        return out


def calibrate(
    model: nn.Module,
    method: str,
    calib_data: torch.Tensor,
    group_size: int,
    *,
    act_order: bool = False,
    damp: float = 0.01,
    calib_device: torch.device | str | None = None,
    skip=("lm_head",),
) -> nn.Module:
    """Quantize the decoder layers' Linears of ``model`` in place with ``method`` ("awq" or "gptq")."""
    layers = decoder_layers(model)
    hidden, kwargs = _first_layer_inputs(model, layers, calib_data)
    with Progress(transient=True) as progress:
        task = progress.add_task(f"int4 {method} calibration", total=len(layers))
        for layer in layers:
            home = next(layer.parameters()).device
            device = torch.device(calib_device) if calib_device is not None else home
            layer.to(device)
            hidden, kwargs = hidden.to(device), _move(kwargs, device)
            linears = _quantizable(layer, group_size, skip)
            records = _record(
                layer, linears, hidden, kwargs, keep_samples=method == "awq", keep_hessian=method == "gptq"
            )
            if method == "awq":
                _apply_awq(layer, linears, records, group_size)
            else:
                _apply_gptq(layer, linears, records, group_size, act_order=act_order, damp=damp)
            with torch.no_grad():
                hidden = _output(layer(hidden, **kwargs))
            layer.to(home)
            progress.advance(task)
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with ``num_hidden_layers`` entries)."""
    config = model.config.get_text_config(decoder=True)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == config.num_hidden_layers:
            return module
    raise ValueError(f"cannot find the {config.num_hidden_layers} decoder layers of {type(model).__name__}")


def _first_layer_inputs(model, layers, calib_data: torch.Tensor):
    captured = {}

    def catch(_module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            model(calib_data.to(next(model.parameters()).device), use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise RuntimeError("the calibration forward never reached the first decoder layer")
    captured["kwargs"] = compat.without_cache(captured["kwargs"])
    captured["kwargs"]["use_cache"] = False
    return captured["hidden"], captured["kwargs"]


def _quantizable(layer: nn.Module, group_size: int, skip) -> dict[str, nn.Linear]:
    found = {}
    for name, module in layer.named_modules():
        if type(module) is not nn.Linear or any(name.endswith(s) for s in skip):  # not bitsandbytes' subclasses
            continue
        if module.in_features % group_size or module.out_features % 8:
            warnings.warn(
                f"hfaccel: {name} ({module.in_features}->{module.out_features}) stays in full precision: "
                f"in_features must be a multiple of group_size={group_size}, out_features of 8",
                stacklevel=2,
            )
            continue
        found[name] = module
    return found


def _record(layer, linears, hidden, kwargs, *, keep_samples: bool, keep_hessian: bool) -> dict[str, _Recorder]:
    """What each of ``linears`` receives in one pass of ``layer``; Linears fed the same input tensors (q/k/v,
    gate/up) share one recorder, so their Hessian is computed once and GPTQ rounds them as one matrix."""
    live: dict[int, _Recorder] = {}  # id of a live input tensor -> its recorder (dropped when the tensor dies)
    received: dict[str, list[_Recorder]] = {name: [] for name in linears}
    finalizers = []

    def receive(name: str, x: torch.Tensor) -> None:
        recorder = live.get(id(x))
        if recorder is None:
            recorder = live[id(x)] = _Recorder()
            finalizers.append(weakref.finalize(x, live.pop, id(x), None))
            recorder.add(x, keep_samples, keep_hessian)
        received[name].append(recorder)

    hooks = [
        linear.register_forward_hook(lambda _m, args, _out, name=name: receive(name, args[0]))
        for name, linear in linears.items()
    ]
    try:
        with torch.no_grad():
            layer(hidden, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
        for finalizer in finalizers:
            finalizer.detach()
    merged: dict[tuple[int, ...], _Recorder] = {}
    for recorders in received.values():
        key = tuple(map(id, recorders))
        if key not in merged:
            merged[key] = _Recorder.merged(recorders)
    return {name: merged[tuple(map(id, recorders))] for name, recorders in received.items()}


def _output(out):
    return out[0] if isinstance(out, tuple) else out


def _move(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    return value


def _replace(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


# ----------------------------------------------------------------------------------------------- AWQ
def _awq_groups(layer: nn.Module, linears: dict[str, nn.Linear]) -> list[tuple[nn.Module, list[str]]]:
    """(module whose output feeds them, Linears sharing that input) for a Llama-style decoder layer."""

    def present(*names):
        return [n for n in names if n in linears]

    groups = []
    norm = getattr(layer, "input_layernorm", None)
    if norm is not None and type(norm).__name__ in RMS_NORMS:
        groups.append((norm, present("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")))
    norm = getattr(layer, "post_attention_layernorm", None)
    if norm is not None and type(norm).__name__ in RMS_NORMS:
        groups.append((norm, present("mlp.gate_proj", "mlp.up_proj")))
    if present("mlp.up_proj", "mlp.down_proj") == ["mlp.up_proj", "mlp.down_proj"]:
        groups.append((linears["mlp.up_proj"], ["mlp.down_proj"]))
    v, o = linears.get("self_attn.v_proj"), linears.get("self_attn.o_proj")
    if v is not None and o is not None and v.out_features == o.in_features:  # not with grouped KV heads
        groups.append((v, ["self_attn.o_proj"]))
    return [(prev, names) for prev, names in groups if names]


def _apply_awq(layer, linears: dict[str, nn.Linear], records: dict[str, _Recorder], group_size: int) -> None:
    scales = {}
    for prev, names in _awq_groups(layer, linears):
        x = records[names[0]].inputs()
        s = _search_scale(x, [linears[n].weight for n in names], group_size)
        scales[id(prev)] = (prev, names, s)
    with torch.no_grad():
        for prev, names, s in scales.values():  # fold: prev output / s, weights * s (same function)
            if isinstance(prev, nn.Linear):
                prev.weight.div_(s[:, None].to(prev.weight.dtype))
                if prev.bias is not None:
                    prev.bias.div_(s.to(prev.bias.dtype))
            else:
                prev.weight.div_(s.to(prev.weight.dtype))
            for name in names:
                linears[name].weight.mul_(s[None, :].to(linears[name].weight.dtype))
    for name, linear in linears.items():
        weight = quantize_rtn(linear.weight, group_size)
        _replace(layer, name, Int4Linear.from_weight(weight, linear.bias, dtype=linear.weight.dtype))


def _search_scale(x: torch.Tensor, weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """Per-input-channel scale ``mean|x|^α`` minimising the group's output error after rounding: the mean square of
    ``x @ (rounded - w).T`` over the ``R`` rows of ``x [R, K]`` and a weight's ``N`` outputs, computed from the
    inputs' Gram matrix ``G = x.T @ x / R`` as ``sum((D @ G) * D) / N`` (``D = rounded - w``), which costs ``K``
    where the product costs ``R`` per output."""
    x_mean = x.abs().mean(0).clamp(min=1e-5)  # [K]
    gram = x.t() @ x / x.shape[0]  # [K, K]
    best, best_error = torch.ones_like(x_mean), float("inf")
    for step in range(AWQ_GRID):
        s = x_mean.pow(step / AWQ_GRID)
        s = s / (s.max() * s.min()).sqrt()
        error = 0.0
        for w in weights:
            w = w.float()
            rounded = rtn_round_trip(w * s[None, :], group_size) / s[None, :]
            d = rounded - w  # [N, K]
            error += ((d @ gram) * d).sum().item() / d.shape[0]
        if error < best_error:
            best, best_error = s, error
    return best


# ---------------------------------------------------------------------------------------------- GPTQ
def _apply_gptq(layer, linears: dict[str, nn.Linear], records: dict[str, _Recorder], group_size: int, **options):
    """Each set of ``linears`` sharing a recorder rounded together (:func:`gptq_quantize`) and replaced in ``layer``."""
    shared: dict[int, list[str]] = {}
    for name in linears:
        shared.setdefault(id(records[name]), []).append(name)
    for names in shared.values():
        hessian = records[names[0]].hessian
        if hessian is None:
            warnings.warn(f"hfaccel: {', '.join(names)} saw no calibration tokens: full precision kept", stacklevel=3)
            continue
        weights = gptq_quantize([linears[n].weight for n in names], hessian, group_size, **options)
        for name, weight in zip(names, weights):
            linear = linears[name]
            _replace(layer, name, Int4Linear.from_weight(weight, linear.bias, dtype=linear.weight.dtype))


def gptq_quantize(
    weights: list[torch.Tensor],
    hessian: torch.Tensor,
    group_size: int,
    *,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
) -> list[Int4Weight]:
    """GPTQ rounding of each ``weight [N_i, K]`` in ``weights``, Linears whose inputs have the Hessian ``[K, K]``.

    GPTQ rounds every output row on its own, so the weights are rounded as one ``[sum N_i, K]`` matrix: one
    sequential pass over the ``K`` columns for all of them. The working copy is transposed (``[K, N]``) so that a
    column is a contiguous row."""
    w = torch.cat([weight.detach().float() for weight in weights]).t().contiguous()  # [K, N]
    h = hessian.float().clone()
    k, n_out = w.shape
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k, device=w.device)
    w, h = w[order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # [K, K]
    q = torch.empty_like(w)  # [K, N] codes, in rounding order
    scales = torch.empty(k // group_size, n_out, device=w.device)  # [G, N]
    zeros = torch.empty_like(scales)
    block_size = max(block_size // group_size, 1) * group_size  # groups never straddle blocks
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        block, errors = w[start:end].clone(), torch.empty(end - start, n_out, device=w.device)  # [B, N] each
        h_block = hinv[start:end, start:end]
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:
                scale, zero = group_params(block[i : i + group_size])
                scales[column // group_size], zeros[column // group_size] = scale, zero
            code = quantize_values(block[i], scale, zero)
            q[column] = code
            torch.div(block[i] - (code - zero) * scale, h_block[i, i], out=errors[i])
            block[i:].addr_(h_block[i, i:], errors[i], alpha=-1)  # spread the error over the columns left
        w[end:].addmm_(hinv[start:end, end:].t(), errors, alpha=-1)
    inverse = torch.argsort(order)
    codes = q[inverse].to(torch.int32)  # [K, N] in original column order
    g_idx = (inverse // group_size).to(torch.int32) if act_order else None  # group of original column j
    dtype, sizes = weights[0].dtype, [weight.shape[0] for weight in weights]
    parts = (t.split(sizes, 1) for t in (codes, scales.to(dtype), zeros.to(dtype)))
    return [
        Int4Weight.from_values(c.contiguous(), s.contiguous(), z.contiguous(), group_size, g_idx)
        for c, s, z in zip(*parts)
    ]
