"""What a request asks for (``SamplingParams``), and the log-probabilities a sampled token comes with."""

from __future__ import annotations

from dataclasses import dataclass, field

from hfaccel.sampling.structured import StructuredOutputs

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_STOP_STRINGS = 16  # each one is searched for after every token (TGI allows 4, OpenAI 4)
GREEDY_BELOW = 1e-5  # a temperature below this decodes greedily, as vLLM does (far below, logits / t overflow)
INT64_MAX = (1 << 63) - 1


class InvalidSamplingParams(ValueError):
    """A sampling parameter out of range; ``param`` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to decode one request (names and meanings as in OpenAI's API and vLLM).

    Every value is checked here, once, for the Python API and the server alike (``validate``): at construction
    without the model, and again with the model's vocabulary size when a request reaches an engine.

    Args:
        max_tokens: new tokens at most (also cut by the model's context length).
        temperature: 0 (or below 1e-5) means greedy; otherwise logits are divided by it before sampling.
        top_p, top_k, min_p: nucleus, top-k (0, -1 or None: off; at most the vocabulary size) and min-p
            (relative to the top token) filters.
        repetition_penalty: > 1 discourages tokens already in the prompt or output (CTRL-style, as transformers).
        presence_penalty, frequency_penalty: OpenAI's additive penalties on tokens already generated.
        stop: up to 16 strings that end the output when they appear (cut from the text, even across token
            boundaries).
        stop_token_ids: token ids that end the output (the model's EOS tokens always do unless ``ignore_eos``).
        ignore_eos: the model's EOS tokens do not end the output (a fixed length: load generators, benchmarks).
        min_tokens: the output's first ``min_tokens`` tokens are never EOS or a stop token, and no stop string ends
            the output before them.
        logit_bias: token id -> a number in [-100, 100] added to that token's logit before sampling (greedy rows
            too), as OpenAI's ``logit_bias``: -100 all but bans a token, 100 all but forces it.
        seed: any int; makes this request's sampling reproducible. Its random numbers are a fixed function of
            (seed, completion index, output position, token id) — the same on any device, in any batch, after
            preemption, across restarts — and each token is drawn by an exponential race that depends on the
            logits only through which candidate wins. So the same seed, prompt and parameters on the same model,
            dtype and device give the same tokens alone or in any batch, after preemption and across restarts;
            where a batch rounds the logits differently, a token can change only at a near-tie of the race as
            close as that rounding (about half the rounding's size, in logits at temperature 1, per token:
            negligible in fp32). Another GPU model, dtype or kernel version computes other logits: not covered.
            The n completions of a request each have their own stream. None: torch's global generator.
        n: completions per prompt; they share the prompt's KV blocks.
        logprobs: return the chosen token's log-probability and this many top alternatives (None: none).
        prompt_logprobs: return each prompt token's log-probability given the tokens before it, and this many top
            alternatives (None: none; the first token has none). The prompt is computed again for them (no prefix
            cache hits).
        skip_special_tokens: leave special tokens out of the text.
        structured_outputs: constrain the output to a JSON schema, a regex, a choice of strings or a grammar
            (:class:`hfaccel.StructuredOutputs`, or the dict vLLM's clients send: ``{"json": schema}``, ...); EOS
            only where the grammar may end. Needs the engine's tokenizer and xgrammar (``hfaccel[structured]``).
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
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | dict | None = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs.from_dict(self.structured_outputs)
            except (TypeError, ValueError) as error:
                raise InvalidSamplingParams("structured_outputs", str(error)) from error
        self.stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        self.stop_token_ids = self.stop_token_ids or []
        _check(isinstance(self.stop, (list, tuple)), "stop", "a string or a list of strings", self.stop)
        _check(
            isinstance(self.stop_token_ids, (list, tuple)), "stop_token_ids", "a list of token ids", self.stop_token_ids
        )
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise :class:`InvalidSamplingParams` (a ValueError) naming the first parameter out of range.

        Without ``vocab_size`` the bounds are those any model shares (every integer fits an int64 tensor); an
        engine passes its model's vocabulary size, which bounds ``top_k``, ``logprobs`` and ``stop_token_ids``.
        """
        vocab = INT64_MAX if vocab_size is None else vocab_size
        ids = "int64 token ids >= 0" if vocab_size is None else f"token ids in [0, {vocab_size}) (the vocabulary)"
        _check(
            _integer(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX,
            "max_tokens",
            "an int64 >= 1",
            self.max_tokens,
        )
        _check(
            _number(self.temperature) and 0 <= self.temperature <= 100,
            "temperature",
            "a number in [0, 100]",
            self.temperature,
        )
        _check(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(
            self.top_k is None or (_integer(self.top_k) and -1 <= self.top_k <= vocab),
            "top_k",
            "None, -1 or 0 (off), or "
            + ("an int64 >= 1" if vocab_size is None else f"an int in [1, {vocab_size}] (the vocabulary size)"),
            self.top_k,
        )
        _check(_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        _check(
            _number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
            "repetition_penalty",
            "a number in (0, 100]",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]", value)
        _check(
            len(self.stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            f"at most {MAX_STOP_STRINGS} non-empty strings",
            self.stop,
        )
        _check(
            all(_integer(t) and 0 <= t < vocab for t in self.stop_token_ids), "stop_token_ids", ids, self.stop_token_ids
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a bool", self.ignore_eos)
        _check(
            _integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an int in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        bias = self.logit_bias
        _check(
            bias is None
            or isinstance(bias, dict)
            and all(
                _integer(t) and 0 <= t < vocab and _number(v) and abs(v) <= MAX_LOGIT_BIAS for t, v in bias.items()
            ),
            "logit_bias",
            f"a dict of {ids} to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            bias,
        )
        _check(self.seed is None or _integer(self.seed), "seed", "an int or None", self.seed)
        _check(_integer(self.n) and 1 <= self.n <= 128, "n", "an int in [1, 128]", self.n)
        most = min(MAX_LOGPROBS, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_integer(value) and 0 <= value <= most), name, f"None or an int in [0, {most}]", value
            )
        _check(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "a bool", self.skip_special_tokens)
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
            "structured_outputs",
            "None, a StructuredOutputs or a dict",
            self.structured_outputs,
        )

    @property
    def uses_top_k(self) -> bool:
        return bool(self.top_k) and self.top_k > 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise InvalidSamplingParams(name, f"SamplingParams.{name} must be {expected}; got {got!r:.200}")


@dataclass
class TokenLogprob:
    """The log-probability of a generated token and of the most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, most likely first
