"""What ``hfaccel serve``'s options set (:class:`ServerConfig`), and what one app's handlers share while it serves
(:class:`ServerState`: the engine, the chat features its template has, the requests in flight, shutdown)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from hfaccel.engine import AsyncEngine
from hfaccel.sampling.structured import tag_ids
from hfaccel.serve.metrics import Metrics
from hfaccel.serve.reasoning import END, START, detect_reasoning
from hfaccel.serve.reasoning import PARSERS as REASONING_PARSERS
from hfaccel.serve.responses import ResponseStore
from hfaccel.serve.tools import PARSERS as TOOL_PARSERS
from hfaccel.serve.tools import ToolParser, detect_parser

MAX_BODY_BYTES = 8 << 20
REQUEST_TIMEOUT_S = 600.0  # the openai client's own default timeout: no one waits for a longer answer
READ_TIMEOUT_S = 30.0  # for a request's headers, then for its body


@dataclass
class ServerConfig:
    """The options of one server (``hfaccel serve``'s flags)."""

    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # requests (prompts) in flight at most; more get 429
    request_timeout: float | None = REQUEST_TIMEOUT_S  # seconds a request may run; None: no limit
    read_timeout: float = READ_TIMEOUT_S  # seconds a client gets to send a request's headers, then its body
    max_body_bytes: int = MAX_BODY_BYTES
    tool_call_parser: str = "auto"  # a name of tools.PARSERS, "auto" (from the chat template) or "none"
    reasoning_parser: str = "auto"  # a name of reasoning.PARSERS, "auto" (from the chat template) or "none"
    allowed_origins: tuple[str, ...] = ()  # origins browsers may call from (CORS); "*": any
    max_stored_responses: int = 1000  # /v1/responses kept for previous_response_id (oldest dropped); 0: none
    allowed_media_domains: tuple[str, ...] = ()  # hosts (and subdomains) http(s) image URLs come from; (): any

    def __post_init__(self):
        for field_name, names in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
            if getattr(self, field_name) not in ("auto", "none", *names):
                raise ValueError(
                    f"{field_name} must be 'auto', 'none' or one of {', '.join(names)}; got "
                    f"{getattr(self, field_name)!r}"
                )
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0; got {self.max_stored_responses}")


@dataclass
class ServerState:
    """What the handlers of one app share."""

    engine: AsyncEngine
    config: ServerConfig
    metrics: Metrics
    tool_parser: type[ToolParser] | None  # how tool_choice="auto" reads calls (None: it reads none)
    reasoning: bool  # outputs' <think> text goes to reasoning_content
    reasoning_tags_are_tokens: bool  # <think> and </think> are single tokens: a constraint can wait for the answer
    responses: ResponseStore
    in_flight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # shutdown began: new requests get 503
    stopping: asyncio.Event = field(default_factory=asyncio.Event)  # its grace period is over: end the rest

    @classmethod
    def serving(cls, engine: AsyncEngine, config: ServerConfig) -> ServerState:
        """The state of an app serving ``engine``: its chat features as configured or read off its template."""
        tool_parser, reasoning = _chat_features(config, engine.engine.processor or engine.engine.tokenizer)
        return cls(
            engine,
            config,
            Metrics(engine),
            tool_parser,
            reasoning,
            _single_tokens(engine.engine, (START, END)),
            ResponseStore(config.max_stored_responses),
        )

    def drain(self, grace_s: float) -> None:
        """Shutdown began (in the event loop): refuse new requests; ``grace_s`` seconds from now, end those in
        flight cleanly."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace_s, self.stopping.set)


def _chat_features(config: ServerConfig, tokenizer) -> tuple[type[ToolParser] | None, bool]:
    """(the parser of ``tool_choice="auto"``'s calls, whether reasoning is split out): as configured, or ("auto")
    from what the tokenizer's chat template writes."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: what any of them writes
        template = "\n".join(template.values())
    parser = detect_parser(template) if config.tool_call_parser == "auto" else config.tool_call_parser
    reasoning = detect_reasoning(template) if config.reasoning_parser == "auto" else config.reasoning_parser != "none"
    return (None if parser in (None, "none") else TOOL_PARSERS[parser]), reasoning


def _single_tokens(engine, tags: tuple[str, ...]) -> bool:
    """Whether each of ``tags`` is one token of the engine's tokenizer."""
    if engine.tokenizer is None:
        return False
    try:
        tag_ids(engine.tokenizer, tags, engine.vocab_size)
    except ValueError:
        return False
    return True
