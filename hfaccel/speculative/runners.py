"""The runners speculative decoding keeps across calls: the target's and the draft model's, with their KV pools and
static steps."""

from __future__ import annotations

import torch

from hfaccel.device import model_device
from hfaccel.kv import KVPool
from hfaccel.kv.fp8 import KVScales
from hfaccel.runner import ModelRunner, compiles
from hfaccel.runner.graphs import DEFAULT_LADDER, context_bucket

MIN_RUNNERS_CONTEXT = 256  # eager runners are rebuilt whole (both models') past their bucket: a wide one keeps them


class SpeculativeRunners:
    """The target's and the draft model's runners — KV pools, compiled and captured steps — kept across
    :func:`speculative_generate` calls (``generate(assistant_model=...)`` on an accelerated model keeps one per
    model). Their static steps are built once for every ladder batch size and, compiled or captured, the models'
    whole context (as ``generate()``'s decode steps are); a call that needs more KV blocks swaps larger pools in
    under them, so nothing compiles again. Only another model, dtype, device, draft count or compile setting, a
    batch past the ladder or a context past the model's builds them anew. ``kv_cache_dtype``, ``kv_scales``: how
    both pools store K/V (``hfaccel.kv.fp8``; None scales: each model's checkpoint's)."""

    def __init__(self, kv_cache_dtype: torch.dtype | None = None, kv_scales: KVScales = None):
        self.pool_options = {"kv_cache_dtype": kv_cache_dtype, "kv_scales": kv_scales}  # KVPool's: how K/V are stored
        self._key: tuple | None = None
        self.target: ModelRunner | None = None
        self.draft: ModelRunner | None = None

    def get(
        self, model, draft_model, rows: int, capacity: list[int], k: int, block_size: int, compile: bool | str
    ) -> tuple[ModelRunner, ModelRunner | None]:
        """Empty runners for ``rows`` sequences of up to ``capacity[i]`` tokens, verifying ``k`` drafts a step."""
        length = max(capacity)
        blocks = sum(-(-c // block_size) for c in capacity) + 1
        key = (
            id(model),
            model.dtype,
            model_device(model),
            k,
            block_size,
            compile,
            id(draft_model),
            None if draft_model is None else (draft_model.dtype, model_device(draft_model)),
        )
        graphs = None if self.target is None else self.target.graphs
        if key != self._key or graphs.max_batch < rows or graphs.max_model_len < length:
            self.release()
            self.target = self._runner(model, blocks, block_size, rows, length, compile, tokens_per_seq=k + 1)
            self.draft = (
                None
                if draft_model is None
                else self._runner(draft_model, blocks, block_size, rows, length, compile, catch_up=True)
            )
            self._key = key
        for runner in (self.target, self.draft):
            if runner is None:
                continue
            if runner.pool.num_blocks < blocks:
                grown = max(blocks, 2 * runner.pool.num_blocks)
                runner.replace_pool(lambda runner=runner: self._pool(runner.model, grown, block_size))
            runner.pool.manager.reset()  # a call that raised may have left sequences behind
        return self.target, self.draft

    def _runner(
        self,
        model,
        blocks: int,
        block_size: int,
        rows: int,
        length: int,
        compile: bool | str,
        tokens_per_seq: int = 1,
        catch_up: bool = False,
    ) -> ModelRunner:
        """A runner with static steps of ``tokens_per_seq`` tokens per sequence (the target's verification, the
        draft's drafting) and, for a draft (``catch_up``), of the one or two tokens it catches up on each step
        (the token the target chose, after the last draft when every draft was accepted)."""
        runner = ModelRunner(model, self._pool(model, blocks, block_size))
        compiled = compiles(compile, runner.device)
        max_batch = max(rows, DEFAULT_LADDER[-1])
        max_len = context_bucket(
            length, whole=compiled or runner.device.type == "cuda", model=model, floor=MIN_RUNNERS_CONTEXT
        )
        runner.enable_decode_graphs(max_batch, max_len, tokens_per_seq=tokens_per_seq, compile=compiled)
        if catch_up:
            runner.enable_catch_up_graphs(max_batch, max_len, tokens_per_seq=2, compile=compiled)
        return runner

    def _pool(self, model, blocks: int, block_size: int) -> KVPool:
        return KVPool.for_model(model, num_blocks=blocks, block_size=block_size, **self.pool_options)

    def release(self) -> None:
        """Give back the runners' memory now."""
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.release()
        self.target = self.draft = self._key = None
