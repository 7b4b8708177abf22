"""Where hfaccel depends on a detail of torch that moves between releases (inductor, dynamo, DTensor).
Supported: torch 2.11 (the GPU machines) through 2.13 (CI). Each shim says which releases it exists for and which
floor deletes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from packaging.version import Version
from torch.distributed.tensor import DTensor


# ---- compiled steps: one graph for every batch size (inductor_backend: transformers < 5.19's RoPE; delete at a
# transformers 5.19 floor) ----
def inductor_backend(graph: torch.fx.GraphModule, example_inputs) -> Callable:
    """torch.compile's inductor, given a graph in which no ``cat`` repeats a tensor (:func:`_distinct_cat_inputs`).
    Inductor decomposes a cat of one tensor repeated into unsqueeze-expand-flatten, and flattening the expanded view
    of a transposed tensor guards on its size being 1: transformers < 5.19's RoPE concatenates its transposed
    frequencies with themselves, so a step traced at one token recompiled at two (and back). A cat of distinct
    inputs is lowered by inductor's own ``cat``, with no guard. (A decomposition table of our own would do the same
    but makes inductor's graphs uncacheable.)"""
    from torch._inductor.compile_fx import compile_fx

    _distinct_cat_inputs(graph)
    return compile_fx(graph, example_inputs)


def _distinct_cat_inputs(graph: torch.fx.GraphModule) -> None:
    """Give every repeat of a tensor in a ``torch.cat`` of dynamo's graph an alias of its own (``view_as``)."""
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or node.target is not torch.cat or not isinstance(node.args[0], (list, tuple)):
            continue
        inputs, seen = list(node.args[0]), set()
        for i, tensor in enumerate(inputs):
            if tensor in seen:
                with graph.graph.inserting_before(node):
                    inputs[i] = graph.graph.call_method("view_as", (tensor, tensor))
            seen.add(tensor)
        node.args = (inputs, *node.args[1:])
    graph.recompile()


def marked_sizes_only():
    """A context in which torch.compile gives every dimension marked dynamic a symbol of its own, whatever its size
    when traced: no "duck sizing" (two dimensions that happen to be equal are not assumed equal forever) and, where
    torch has the setting (``backed_size_oblivious``), no specialising of sizes 0 and 1 (a graph
    traced at batch 1 serves every batch). Scoped to the call; torch's settings are unchanged outside it."""
    from torch.fx.experimental import _config

    return _config.patch(use_duck_shape=False, backed_size_oblivious=True)


def compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions ``torch.compile`` raises when it cannot compile a function (dynamo's; inductor's failures
    reach the caller wrapped in one of them), as opposed to errors of the function itself."""
    from torch._dynamo import exc

    # reaching the recompile limit under fullgraph=True raises FailOnRecompileLimitHit, which is not a
    # TorchDynamoException (it derives from Exception)
    return exc.TorchDynamoException, exc.FailOnRecompileLimitHit


# ---- a long cumsum in a compiled step: inductor's split scan (torch < 2.13; delete at a 2.13 floor) ----
SPLIT_SCAN_FAILS = Version(torch.__version__).release < (2, 13)


@torch.library.custom_op("hfaccel::cumsum", mutates_args=())
def opaque_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cumsum(x, dim)`` of a float tensor as an op inductor calls rather than generates (contiguous out)."""
    return torch.cumsum(x.contiguous(), dim)


@opaque_cumsum.register_fake
def _(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cumsum(x, dim)`` of a float tensor, fit for a compiled step on every torch: before 2.13 inductor's
    split-scan code generation fails on a long scan whose input reads a per-row value (pytorch#180221, fixed in
    2.13), so there the cumsum is an opaque op (:func:`opaque_cumsum`)."""
    return opaque_cumsum(x, dim) if SPLIT_SCAN_FAILS else torch.cumsum(x, dim)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter transformers' TP sharded (a ``DTensor``: its local shard); other tensors as
    they are."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
