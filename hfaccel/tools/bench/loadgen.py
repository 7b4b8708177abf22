"""A load generator for an OpenAI-compatible server: N streaming requests at a fixed concurrency.

    python -m hfaccel.tools.bench.loadgen --url http://127.0.0.1:8000/v1 --model NAME --requests 200 \\
        --concurrency 200 --max-tokens 16 [--out results.json]

Uses the official ``openai`` client (``AsyncOpenAI``), one streaming completion per request, prompts cycled
from ``--prompt`` (or a built-in set), temperature 0. Prints throughput and latency / TTFT percentiles; with
``--out`` writes every request's text, token count, finish reason, latency and error as JSON. Bounded: each
request has ``--timeout`` seconds, the whole run ``--deadline`` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass

DEFAULT_PROMPTS = [
    "the cat sat on",
    "hello world",
    "a",
    "once upon a time there was",
    "x y z",
    "the quick brown fox jumps over the lazy dog",
]


@dataclass
class Result:
    index: int
    prompt: str
    text: str = ""
    chunks: int = 0
    finish_reason: str | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    error: str | None = None


@dataclass
class Summary:
    requests: int
    concurrency: int
    ok: int
    errors: int
    seconds: float
    chunks_per_s: float
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


async def _one(client, model: str, index: int, prompt: str, max_tokens: int, gate: asyncio.Semaphore) -> Result:
    result = Result(index, prompt)
    async with gate:
        start = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            async for chunk in stream:
                if not chunk.choices:
                    continue
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                result.text += chunk.choices[0].text
                result.chunks += 1
                result.finish_reason = chunk.choices[0].finish_reason or result.finish_reason
            result.latency_s = time.perf_counter() - start
        except Exception as error:  # reported per request; the run goes on
            result.error = f"{type(error).__name__}: {error}"
    return result


async def run_load(
    url: str,
    model: str,
    prompts: list[str],
    requests: int,
    concurrency: int,
    max_tokens: int,
    timeout: float = 60.0,
    deadline: float = 300.0,
    api_key: str = "none",
):
    """(per-request results, summary) of ``requests`` streaming completions at ``concurrency``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key, timeout=timeout, max_retries=0)
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()
    jobs = [_one(client, model, i, prompts[i % len(prompts)], max_tokens, gate) for i in range(requests)]
    results = await asyncio.wait_for(asyncio.gather(*jobs), deadline)
    seconds = time.perf_counter() - start
    await client.close()
    return results, summarize(results, concurrency, seconds)


def summarize(results: list[Result], concurrency: int, seconds: float) -> Summary:
    ok = [r for r in results if r.error is None]
    return Summary(
        len(results),
        concurrency,
        len(ok),
        len(results) - len(ok),
        seconds,
        sum(r.chunks for r in ok) / seconds,
        *percentiles_ms([r.latency_s for r in ok]),
        *percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
    )


def percentiles_ms(values: list[float]) -> tuple[float | None, float | None]:
    """(p50, p99) in milliseconds of values in seconds; (None, None) for no values."""
    if not values:
        return None, None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3  # noqa: E731
    return pick(0.5), pick(0.99)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="base URL including /v1")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt", action="append", help="prompts to cycle through (repeatable)")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results, summary = asyncio.run(
        run_load(
            args.url,
            args.model,
            args.prompt or DEFAULT_PROMPTS,
            args.requests,
            args.concurrency,
            args.max_tokens,
            args.timeout,
            args.deadline,
            args.api_key,
        )
    )
    print(
        f"{summary.ok}/{summary.requests} ok in {summary.seconds:.2f}s at concurrency {summary.concurrency}: "
        f"latency p50 {summary.latency_p50_ms} ms, p99 {summary.latency_p99_ms} ms; "
        f"TTFT p50 {summary.ttft_p50_ms} ms, p99 {summary.ttft_p99_ms} ms; {summary.chunks_per_s:.1f} tokens/s"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": asdict(summary), "results": [asdict(r) for r in results]}, f, indent=1)
    return 0 if summary.errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
