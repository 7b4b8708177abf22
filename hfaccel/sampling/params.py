"""What a request asks for (``SamplingParams``), and the log-probabilities a sampled token comes with."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to decode one request (names and meanings as in OpenAI's API and vLLM).

    Args:
        max_tokens: new tokens at most (also cut by the model's context length).
        temperature: 0 means greedy; otherwise logits are divided by it before sampling.
        top_p, top_k, min_p: nucleus, top-k (0 or None: off) and min-p (relative to the top token) filters.
        repetition_penalty: > 1 discourages tokens already in the prompt or output (CTRL-style, as transformers).
        presence_penalty, frequency_penalty: OpenAI's additive penalties on tokens already generated.
        stop: strings that end the output when they appear (cut from the text, even across token boundaries).
        stop_token_ids: token ids that end the output (the model's EOS tokens always do unless ``ignore_eos``).
        seed: makes this request's sampling reproducible whatever else runs in the same batch.
        n: completions per prompt; they share the prompt's KV blocks.
        logprobs: return the chosen token's log-probability and this many top alternatives (None: none).
        skip_special_tokens: leave special tokens out of the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raise ValueError naming the first parameter out of range."""
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an int >= 1",
               self.max_tokens)
        _check(_number(self.temperature) and 0 <= self.temperature <= 100, "temperature", "a number in [0, 100]",
               self.temperature)
        _check(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(self.top_k is None or (isinstance(self.top_k, int) and self.top_k >= -1), "top_k",
               "None, -1, 0 (off) or a positive int", self.top_k)
        _check(_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        _check(_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100, "repetition_penalty",
               "a number in (0, 100]", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "token ids >= 0", self.stop_token_ids)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "an int or None", self.seed)
        _check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an int in [1, 128]", self.n)
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.logprobs)

    @property
    def uses_top_k(self) -> bool:
        return bool(self.top_k) and self.top_k > 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}; got {got!r}")


@dataclass
class TokenLogprob:
    """The log-probability of a generated token and of the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, most likely first
