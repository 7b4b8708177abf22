"""Reading a PEFT LoRA adapter directory into host tensors, checked against the layers that will serve it.

A PEFT adapter directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ...) and ``adapter_model.safetensors`` (or ``adapter_model.bin``) whose tensors are named after
the wrapped model's modules: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` is the ``A [r, K]``
of module ``model.layers.0.self_attn.q_proj``, ``...lora_B.weight`` its ``B [N, r]``. The modules served are those the
file holds weights for: what PEFT wrapped (``target_modules``, ``layers_to_transform`` and ``exclude_modules`` were
applied when the adapter was made). ``fan_in_fan_out`` only concerns GPT-2's Conv1D layers (PEFT turns it off for
``nn.Linear``), which are not served. A layer's update is
``y += scaling * (x @ A.T) @ B.T`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA): the scaling is
folded into ``B`` here, once.

Only plain LoRA on Linear layers is served; everything else is refused with a ``ValueError`` saying what was
expected and what was given (DoRA, LoRA biases, ``modules_to_save``, embeddings, a target the base lacks or of
another shape, a rank above the engine's ``max_lora_rank``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# options of a LoRA config that change what the adapter computes and that hfaccel does not implement: truthy -> refused
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora=true) rescales each weight's columns by a learned magnitude",
    "modules_to_save": "modules_to_save replaces whole modules (trained copies) besides the LoRA weights",
    "lora_bias": "lora_bias=true adds a trained bias to each LoRA B",
    "layer_replication": "layer_replication duplicates decoder layers",
    "trainable_token_indices": "trainable_token_indices trains rows of the embedding",
    "target_parameters": "target_parameters puts LoRA on bare parameters (MoE experts), not on Linear layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) turns the adapter on mid-sequence",
    "use_qalora": "QALoRA (use_qalora=true) pools the inputs by quantization group",
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)  # adapter ids, never reused in a process: they key the prefix cache


@dataclass(eq=False)
class LoRAAdapter:
    """One LoRA adapter held on the host, ready to be copied into a slot of the engine's pool.

    ``weights[module] = (A [r, K], B [N, r])`` in the model's dtype, ``B`` scaled by the module's ``scaling``.
    ``id`` is unique in the process (an adapter removed and added again under the same name gets a new one), so
    ``cache_key`` never lets one adapter's cached K/V serve another.
    """

    name: str
    path: str
    rank: int  # the largest rank over its modules
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def cache_key(self) -> tuple[str, int]:
        """What the prefix cache mixes into the hash of this adapter's first block (``BlockManager`` ``salt``)."""
        return ("lora", self.id)

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)


def load_adapter(
    name: str,
    path: str | os.PathLike,
    layers: Mapping[str, tuple[int, int]],
    *,
    max_rank: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
    describe_missing=None,
) -> LoRAAdapter:
    """Read and check the PEFT LoRA adapter at ``path`` for layers ``layers[module] = (in_features, out_features)``.

    Returns host tensors in ``dtype`` (pinned with ``pin_memory``: copies to a GPU then need no sync).
    ``describe_missing(module)`` says why a module the adapter targets is not among ``layers`` (the manager knows
    whether the base lacks it, or has it as another kind of layer); raises ``ValueError`` for anything hfaccel
    cannot serve exactly.
    """
    if not isinstance(name, str) or not name or name != name.strip():
        raise ValueError(f"a LoRA adapter's name must be a non-empty string without surrounding spaces; got {name!r}")
    config, tensors = read_peft_adapter(path)
    where = f"LoRA adapter {name!r} ({path})"
    _check_config(config, where)
    pairs = _pairs(tensors, where)
    weights, rank = {}, 0
    for module, (a, b) in sorted(pairs.items()):
        if module not in layers:
            reason = describe_missing(module) if describe_missing is not None else "the base model has no such layer"
            raise ValueError(f"{where} targets {module!r}, which cannot take it: {reason}")
        r = _check_shapes(module, a, b, layers[module], max_rank, where)
        _check_rank_pattern(config, module, r, where)
        scaling = _scaling(config, module, r)
        weights[module] = (_host(a, dtype, pin_memory), _host(b.float() * scaling, dtype, pin_memory))
        rank = max(rank, r)
    return LoRAAdapter(name, str(path), rank, weights)


def read_peft_adapter(path: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config.json as a dict, tensors by name)`` of a PEFT adapter directory, or a ``ValueError`` saying
    what the directory lacks."""
    folder = Path(path)
    expected = f"a PEFT adapter directory ({CONFIG_FILE} and {' or '.join(WEIGHT_FILES)}, as save_pretrained writes)"
    if not folder.is_dir():
        raise ValueError(f"{str(path)!r} is not {expected}: it is {'a file' if folder.exists() else 'missing'}")
    present = sorted(p.name for p in folder.iterdir())[:12]
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if not (folder / CONFIG_FILE).is_file() or weights is None:
        raise ValueError(f"{str(path)!r} is not {expected}; it holds {present}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{folder / CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / CONFIG_FILE} must hold a JSON object; got {type(config).__name__}")
    return config, _read_tensors(weights)


def _read_tensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: say which
        raise ValueError(f"{file} could not be read as adapter weights: {type(error).__name__}: {error}") from None


def _check_config(config: dict, where: str) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where} is a {peft_type} adapter; only LoRA adapters (peft_type LORA) can be served")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{where} trains biases (bias={config['bias']!r}); only adapters with bias='none' can be served"
        )
    for option, what in UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise ValueError(
                f"{where} uses {option}={config[option]!r}: {what}, which hfaccel does not serve; "
                f"only plain LoRA on Linear layers is supported (merge the adapter into the model "
                f"instead: PeftModel.merge_and_unload())"
            )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {CONFIG_FILE} must give a positive number {key!r}; got {value!r}")


def _pairs(tensors: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from PEFT's tensor names; anything that is not a LoRA A or B weight is refused."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(
                f"{where} holds {key!r}: only the lora_A / lora_B weights of Linear layers can be "
                f"served (no embeddings, biases, DoRA magnitudes or saved modules)"
            )
        found.setdefault(match["module"], {})[match["which"]] = tensor
    if not found:
        raise ValueError(f"{where} holds no lora_A / lora_B weights")
    incomplete = sorted(module for module, ab in found.items() if set(ab) != {"A", "B"})
    if incomplete:
        raise ValueError(
            f"{where}: {incomplete[0]!r} has {'lora_A' if 'A' in found[incomplete[0]] else 'lora_B'} "
            "but not both lora_A and lora_B"
        )
    return {module: (ab["A"], ab["B"]) for module, ab in found.items()}


def _check_shapes(
    module: str, a: torch.Tensor, b: torch.Tensor, layer: tuple[int, int], max_rank: int, where: str
) -> int:
    """The module's rank, after checking ``A [r, K]`` and ``B [N, r]`` against the layer ``(K, N)``."""
    k, n = layer
    if a.dim() != 2 or b.dim() != 2 or not a.is_floating_point() or not b.is_floating_point():
        raise ValueError(
            f"{where}: {module!r} needs 2-D floating lora_A [r, {k}] and lora_B [{n}, r]; got "
            f"{a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}"
        )
    r = a.shape[0]
    if a.shape[1] != k or b.shape != (n, r):
        raise ValueError(
            f"{where}: the shapes of {module!r} do not fit the base layer (in_features={k}, "
            f"out_features={n}): expected lora_A [r, {k}] and lora_B [{n}, r]; got lora_A "
            f"{list(a.shape)} and lora_B {list(b.shape)}"
        )
    if not 0 < r <= max_rank:
        raise ValueError(
            f"{where}: {module!r} has rank {r}, above the engine's max_lora_rank={max_rank}; make the "
            f"engine with max_lora_rank >= {r}"
        )
    return r


def _pattern_value(patterns: Mapping | None, module: str, default):
    """PEFT's rule (``peft.utils.other.get_pattern_key``): the first key that matches the end of the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_rank_pattern(config: dict, module: str, r: int, where: str) -> None:
    declared = _pattern_value(config.get("rank_pattern"), module, config["r"])
    if declared != r:
        raise ValueError(
            f"{where}: {CONFIG_FILE} gives {module!r} rank {declared} (r / rank_pattern) but its lora_A has {r} rows"
        )


def _scaling(config: dict, module: str, r: int) -> float:
    """PEFT's scaling of a module: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (alpha from ``alpha_pattern``)."""
    alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _host(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    out = tensor.detach().to("cpu", dtype).contiguous()
    return out.pin_memory() if pin else out
