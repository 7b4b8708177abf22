"""Token counts for the repetition, frequency and presence penalties, kept on the device and updated incrementally.

A penalized sequence has a row of :class:`TokenCounts` for as long as it lives: how many times each token is in its
output (``[V]`` float) and which tokens its prompt holds (``[V]`` bool). A sampling step sends up only what the host
learned since the sequence's last step — its new output tokens (usually one), and the prompt the first time — in
one non-blocking copy, instead of every sequence's whole token lists each step.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from hfaccel.device import to_device


class TokenCounts:
    """Output token counts and prompt tokens per sequence (module docstring), ``vocab`` wide, on ``device``."""

    def __init__(self, vocab: int, device: torch.device, rows: int = 8):
        self.vocab, self.device = vocab, device
        self.output = torch.zeros(rows, vocab, device=device)  # [rows, V]: times each token is in the output
        self.prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)  # [rows, V]: in the prompt
        self._row: dict[Hashable, int] = {}  # sequence -> its row
        self._counted: dict[Hashable, int] = {}  # sequence -> output tokens counted in its row
        self._free = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._row)

    def rows(
        self, keys: Sequence[Hashable], prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """The sequences' rows ``[P]`` (int64, on the device) after counting what is new: the prompt of a sequence
        seen for the first time, and the output tokens past those already counted. ``outputs[i]`` only grows while
        ``keys[i]`` lives (:meth:`release` it when it ends)."""
        rows, new_rows, new_tokens, prompt_rows, prompt_tokens = [], [], [], [], []
        for key, prompt, output in zip(keys, prompts, outputs):
            row = self._row.get(key)
            if row is None:
                row = self._row[key] = self._take_row()
                self._counted[key] = 0
                prompt_rows += [row] * len(prompt)
                prompt_tokens += prompt
            counted = self._counted[key]
            if len(output) < counted:
                raise ValueError(f"sequence {key!r} has {len(output)} output tokens; {counted} were counted before")
            new_rows += [row] * (len(output) - counted)
            new_tokens += output[counted:]
            self._counted[key] = len(output)
            rows.append(row)
        sizes = (len(rows), len(new_rows), len(prompt_rows))
        flat = to_device(rows + new_rows + new_tokens + prompt_rows + prompt_tokens, torch.long, self.device)
        rows_t, new_rows_t, new_tokens_t, prompt_rows_t, prompt_tokens_t = flat.split(
            [sizes[0], sizes[1], sizes[1], sizes[2], sizes[2]]
        )
        if sizes[1]:
            self.output.index_put_(
                (new_rows_t, new_tokens_t), torch.ones_like(new_tokens_t, dtype=torch.float), accumulate=True
            )
        if sizes[2]:
            self.prompt.index_put_((prompt_rows_t, prompt_tokens_t), torch.ones_like(prompt_tokens_t, dtype=torch.bool))
        return rows_t

    def release(self, key: Hashable) -> None:
        """The sequence ended: its row is cleared and free for another (a no-op for a sequence never counted)."""
        row = self._row.pop(key, None)
        if row is None:
            return
        del self._counted[key]
        self.output[row] = 0
        self.prompt[row] = False
        self._free.append(row)

    def _take_row(self) -> int:
        if not self._free:
            old = len(self.output)
            self.output = torch.cat([self.output, torch.zeros_like(self.output)])
            self.prompt = torch.cat([self.prompt, torch.zeros_like(self.prompt)])
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()
