"""``hfaccel serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client and raw HTTP.

The served model is a tiny random Llama with a one-character-per-token tokenizer (tests/models.py), on
hfaccel's torch kernels, so every request is cheap and stop strings always span several tokens.
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest

from tests.helpers import CHAT_TEMPLATE, ROOT, Server
from tests.models import char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    running = Server(model_dir, "--async-scheduling")  # the CUDA default, run on the CPU
    yield running
    assert running.stop() == 0


def _greedy(**kwargs):
    return {"model": "tiny", "temperature": 0, **kwargs}


def test_the_server_says_at_start_up_what_kv_memory_it_reserved(server):
    """``hfaccel serve`` shows hfaccel's INFO lines as uvicorn shows its own: the KV pool its engine reserved, as
    ``/health`` (``engine.stats()``) reports it."""
    health = server.health()
    line = f"INFO:     hfaccel Engine: KV cache of {health['kv_cache_tokens']:,} tokens"
    assert line in server.log_path.read_text(), server.log_path.read_text()[-3000:]


def test_completions_streamed_equal_non_streamed(server):
    client = server.client()
    full = client.completions.create(prompt="the cat", max_tokens=12, **_greedy())
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert len(full.choices[0].text) == 12 and full.usage.completion_tokens == 12 and full.usage.prompt_tokens == 7
    chunks = list(client.completions.create(prompt="the cat", max_tokens=12, stream=True, **_greedy()))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_equal_non_streamed_with_usage(server):
    client = server.client()
    messages = [{"role": "user", "content": "hi there"}]
    full = client.chat.completions.create(messages=messages, max_tokens=10, **_greedy())
    assert full.choices[0].message.role == "assistant" and len(full.choices[0].message.content) == 10
    chunks = list(
        client.chat.completions.create(
            messages=messages, max_tokens=10, stream=True, stream_options={"include_usage": True}, **_greedy()
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_stop_max_tokens_and_logprobs(server):
    client = server.client()
    free = client.completions.create(prompt="abc", max_tokens=20, **_greedy()).choices[0].text
    stop = free[8:10]
    out = client.completions.create(prompt="abc", max_tokens=20, stop=[stop], n=2, logprobs=2, **_greedy())
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.text == free[: free.index(stop)] and choice.finish_reason == "stop"
        assert len(choice.logprobs.tokens) >= len(choice.text)
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    sampled = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=4)
    assert [len(c.text) for c in sampled.choices] == [5, 5, 5]
    multi = client.completions.create(prompt=["ab", "cd"], max_tokens=3, n=2, **_greedy())
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=3, **_greedy()
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 3 for e in entries)
    assert [m.id for m in client.models.list().data] == ["tiny"]


BAD_BODIES = [
    (b"{not json", 400, None),
    (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),  # invalid UTF-8
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": -5}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny", "prompt": "a", "temperature": 7}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny", "prompt": "a", "n": "two"}).encode(), 400, "n"),
    (json.dumps({"model": "nope", "prompt": "a"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "a" * 400}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": [5, 9999]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny", "prompt": "a", "stream": True, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps(["not", "an", "object"]).encode(), 400, None),
    (b'{"model": "tiny", "prompt": "' + b"a" * (9 << 20) + b'"}', 413, None),
    (json.dumps({"model": "tiny", "prompt": "a\ud800b"}).encode(), 400, "prompt"),  # a lone surrogate
    (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),  # nested too deeply
    (b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400, None),  # too many digits to convert
    (json.dumps({"model": "tiny", "prompt": "a", "max_tokens": True}).encode(), 400, "max_tokens"),  # strict types
    (json.dumps({"model": "tiny", "prompt": "a", "stream": "yes"}).encode(), 400, "stream"),
    (json.dumps({"model": "tiny", "prompt": "a", "top_k": 2**70}).encode(), 400, "top_k"),  # no int64 holds it
    (json.dumps({"model": "tiny", "prompt": "a", "top_k": 97}).encode(), 400, "top_k"),  # beyond the vocabulary
    (json.dumps({"model": "tiny", "prompt": "a", "stop_token_ids": [96]}).encode(), 400, "stop_token_ids"),
    (json.dumps({"model": "tiny", "prompt": "a", "logit_bias": {"5": 101}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "tiny", "prompt": "a", "logit_bias": {"x": 1}}).encode(), 400, "logit_bias"),
    (json.dumps({"model": "tiny", "prompt": "a", "min_tokens": 17}).encode(), 400, "min_tokens"),  # > max_tokens
    (json.dumps({"model": "tiny", "prompt": "a", "suffix": "z"}).encode(), 400, "suffix"),  # not implemented
    (json.dumps({"model": "tiny", "prompt": "a", "best_of": 1, "n": 2}).encode(), 400, "best_of"),
    (json.dumps({"model": "tiny", "prompt": "a", "n": 65}).encode(), 400, "n"),  # beyond --max-num-seqs
    (json.dumps({"model": "tiny", "prompt": "a", "top_p": float("nan")}).encode(), 400, "top_p"),
    (json.dumps({"model": "tiny", "prompt": "a", "stop": ["x"] * 17}).encode(), 400, "stop"),
]


@pytest.mark.parametrize("body, status, param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, body, status, param):
    response = httpx.post(
        f"{server.url}/v1/completions", content=body, timeout=30, headers={"content-type": "application/json"}
    )
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"]
        if param is not None:
            assert error["param"] is not None and error["param"].startswith(param), error
    ok = server.client().completions.create(prompt="still here", max_tokens=3, **_greedy())
    assert len(ok.choices[0].text) == 3


def test_bad_chat_input(server):
    for body, status in [
        ({"model": "tiny", "messages": []}, 400),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400),
        ({"model": "tiny", "messages": [{"role": "user", "content": "a\ud800b"}]}, 400),
    ]:
        response = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body).encode(), timeout=30)
        assert response.status_code == status and "error" in response.json(), response.text


def test_unknown_routes_and_methods_get_openai_errors(server):
    for method, path, status in [
        ("GET", "/v1/nope", 404),
        ("POST", "/nope", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/v1/models", 405),
    ]:
        response = httpx.request(method, f"{server.url}{path}", timeout=10)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert path in error["message"] and error["type"] == "invalid_request_error", error


def test_max_tokens_defaults(server):
    client = server.client()
    assert client.completions.create(prompt="a", max_tokens=None, **_greedy()).usage.completion_tokens == 16
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **_greedy())
    room = 256 - chat.usage.prompt_tokens  # the rest of the context, unless the model stops first
    assert chat.usage.completion_tokens == room or chat.choices[0].finish_reason == "stop"


def test_a_bad_request_fails_alone_among_concurrent_streams(server):
    client = server.client()
    prompts = ["the cat sat", "hello", "a b c", "xyz"]
    expected = [client.completions.create(prompt=p, max_tokens=40, **_greedy()).choices[0].text for p in prompts]

    def stream(prompt: str) -> str:
        chunks = client.completions.create(prompt=prompt, max_tokens=40, stream=True, **_greedy())
        return "".join(c.choices[0].text for c in chunks)

    def huge_top_k(streamed: bool) -> int:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(
                prompt="x", max_tokens=40, stream=streamed, extra_body={"top_k": 2**70}, **_greedy()
            )
        return raised.value.body["param"]

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream, p) for p in prompts]
        bad = [pool.submit(huge_top_k, streamed) for streamed in (False, True)]
        assert [f.result(60) for f in bad] == ["top_k", "top_k"]
        assert [f.result(60) for f in streams] == expected
    assert server.wait_idle()["blocks_used"] == 0


def _send_chunked_until_answered(port: int, total: int) -> tuple[int, bytes]:
    """POST a chunked body of up to ``total`` bytes, 1 MiB a chunk, stopping as soon as the server answers:
    (bytes sent, the start of the answer)."""
    chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        try:
            while sent < total and not select.select([sock], [], [], 0)[0]:
                sock.sendall(chunk)
                sent += 1 << 20
        except OSError:  # the server closed the connection
            pass
        return sent, sock.recv(1024)


def test_the_body_limit_holds_while_reading(server):
    """Two 400 MiB chunked bodies are refused once 8 MiB have come, with the server's memory barely moving;
    a Content-Length over the limit is refused before any of the body is sent."""
    process = psutil.Process(server.process.pid)
    before = peak = process.memory_info().rss
    with ThreadPoolExecutor(2) as pool:
        bodies = [pool.submit(_send_chunked_until_answered, server.port, 400 << 20) for _ in range(2)]
        while not all(f.done() for f in bodies):
            peak = max(peak, process.memory_info().rss)
            time.sleep(0.005)
    for sent, answer in (f.result() for f in bodies):
        assert answer.startswith(b"HTTP/1.1 413") and sent < 100 << 20, (sent, answer)
    assert peak - before < 64 << 20, f"the server's RSS grew by {(peak - before) >> 20} MiB"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: 1000000000\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 413")
    ok = server.client().completions.create(prompt="still here", max_tokens=3, **_greedy())
    assert len(ok.choices[0].text) == 3


def test_a_disconnected_non_streamed_request_is_aborted(server):
    server.wait_idle()
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 240, "n": 8, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        deadline = time.monotonic() + 10
        while server.health()["running"] < 8:  # its prompt computed, its 8 completions decoding
            assert time.monotonic() < deadline, server.health()
            time.sleep(0.01)
    assert server.wait_idle(timeout=1.0)["blocks_used"] == 0  # freed within a second of the disconnect
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'hfaccel_requests_total{endpoint="/v1/completions",status="499"} 1.0' in metrics  # aborted, not done


def test_disconnect_mid_stream_frees_blocks(server):
    idle = server.wait_idle()
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            assert server.health()["blocks_used"] > 0
    assert server.wait_idle()["blocks_used"] == idle["blocks_used"] == 0


def test_metrics_in_prometheus_format(server):
    server.client().completions.create(prompt="metrics", max_tokens=4, **_greedy())
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    for name in (
        "hfaccel_requests_total",
        "hfaccel_prompt_tokens_total",
        "hfaccel_generation_tokens_total",
        "hfaccel_time_to_first_token_seconds_bucket",
        "hfaccel_inter_token_latency_seconds_bucket",
        "hfaccel_queue_depth",
        "hfaccel_running_sequences",
        "hfaccel_kv_blocks_used",
        "hfaccel_kv_blocks_free",
    ):
        assert name in text, name
    assert 'hfaccel_requests_total{endpoint="/v1/completions",status="200"}' in text


@pytest.mark.slow
def test_200_concurrent_streams_from_another_process(server, tmp_path):
    prompts = ["the cat sat on", "hello world", "a", "once upon a time there was"]
    expected = {
        p: server.client().completions.create(prompt=p, max_tokens=16, **_greedy()).choices[0].text for p in prompts
    }
    out = tmp_path / "load.json"
    command = [
        sys.executable,
        "-m",
        "hfaccel.tools.bench.loadgen",
        "--url",
        f"{server.url}/v1",
        "--model",
        "tiny",
        "--requests",
        "200",
        "--concurrency",
        "200",
        "--max-tokens",
        "16",
        "--deadline",
        "240",
        "--out",
        str(out),
        *[arg for p in prompts for arg in ("--prompt", p)],
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    print(done.stdout)  # p50 / p99 latency and TTFT
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["summary"]["ok"] == 200
    for result in results["results"]:
        assert result["text"] == expected[result["prompt"]] and result["finish_reason"] == "length"
    assert server.wait_idle()["blocks_used"] == 0


@pytest.fixture(scope="module")
def guarded(model_dir):
    running = Server(
        model_dir, "--api-key", "sesame", "--max-queue", "2", "--request-timeout", "0.3", "--read-timeout", "1"
    )
    yield running
    assert running.stop() == 0


def test_api_key(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").completions.create(prompt="a", max_tokens=2, **_greedy())
    assert httpx.post(f"{guarded.url}/v1/completions", json={"model": "tiny", "prompt": "a"}).status_code == 401
    ok = guarded.client("sesame").completions.create(prompt="a", max_tokens=2, **_greedy())
    assert len(ok.choices[0].text) == 2
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # health and metrics stay open for probes


def test_overload_gets_429_at_once(guarded):
    body = {"model": "tiny", "prompt": "load", "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"Authorization": "Bearer sesame"}
    with httpx.Client(timeout=30, headers=headers) as http:
        with (
            http.stream("POST", f"{guarded.url}/v1/completions", json=body) as first,
            http.stream("POST", f"{guarded.url}/v1/completions", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200
            start = time.monotonic()
            third = http.post(f"{guarded.url}/v1/completions", json={**body, "stream": False})
            assert third.status_code == 429 and time.monotonic() - start < 5
            assert third.json()["error"]["type"] == "rate_limit_error"
    guarded.wait_idle()


def test_a_request_that_can_never_be_admitted_is_a_400(guarded):
    response = httpx.post(
        f"{guarded.url}/v1/completions",
        headers={"Authorization": "Bearer sesame"},
        timeout=10,
        json={"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 2},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def _trickle(port: int, head: bytes, drip: bytes, give_up_s: float = 10.0) -> tuple[float, bytes]:
    """Send ``head``, then ``drip`` one byte every 0.1 s, until the server answers or closes the connection:
    (seconds it took, the answer)."""
    start, answer = time.monotonic(), b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            sock.sendall(head)
            for byte in drip:
                if time.monotonic() - start > give_up_s:
                    break
                if select.select([sock], [], [], 0.1)[0]:
                    while data := sock.recv(65536):
                        answer += data
                    break
                sock.sendall(bytes([byte]))
        except OSError:  # reset by the server
            pass
    return time.monotonic() - start, answer


def test_slow_clients_are_cut_off(guarded):
    """slowloris: headers or a body trickling in are cut off after --read-timeout (1 s); others are served."""
    request = b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer sesame\r\n"
    with ThreadPoolExecutor(5) as pool:
        headers = [pool.submit(_trickle, guarded.port, request, b"X-Slow: " + b"a" * 200) for _ in range(3)]
        bodies = [
            pool.submit(_trickle, guarded.port, request + b"Content-Length: 500\r\n\r\n", b" " * 500) for _ in range(2)
        ]
        time.sleep(0.3)
        ok = guarded.client("sesame").completions.create(prompt="a", max_tokens=2, **_greedy())
        assert len(ok.choices[0].text) == 2
        for seconds, answer in (f.result() for f in headers):
            assert seconds < 5 and answer == b"", (seconds, answer)  # closed without an answer
        for seconds, answer in (f.result() for f in bodies):
            assert seconds < 5 and answer.startswith(b"HTTP/1.1 408") and b'"timeout_error"' in answer, answer


def test_request_timeout_aborts(guarded):
    client = guarded.client("sesame")
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(prompt="slow", max_tokens=240, **_greedy())
    assert raised.value.status_code == 408
    assert guarded.wait_idle()["blocks_used"] == 0


def test_sigterm_shuts_down_cleanly_with_a_request_in_flight(model_dir):
    running = Server(model_dir)
    body = {"model": "tiny", "prompt": "bye", "max_tokens": 240, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{running.url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            running.process.send_signal(signal.SIGTERM)
            rest = list(lines)  # finished or cut off cleanly: the connection closes, no hang
    assert running.process.wait(30) == 0
    running.log.close()
    assert all(line.startswith("data: ") or not line for line in rest)


def test_a_lost_device_ends_the_server(model_dir):
    """The device raises an error it keeps (tests/serve/device_lost: a CUDA illegal memory access, simulated): the
    request gets a 503 naming DeviceLostError, and the server drains and exits with status 1 — for its supervisor
    to restart it — rather than fail every request from then on."""
    from pathlib import Path

    lose = {"PYTHONPATH": str(Path(__file__).parent / "device_lost"), "HFACCEL_TEST_LOSE_DEVICE": "20"}
    running = Server(model_dir, env=lose)
    assert running.client().completions.create(**_greedy(prompt="short", max_tokens=3)).choices
    log = running.ended_by(
        lambda: running.client().completions.create(**_greedy(prompt="more than twenty tokens long", max_tokens=3)),
        "DeviceLostError",
    )
    assert "hfaccel serve: the engine stopped: DeviceLostError" in log and "illegal memory access" in log, log[-3000:]


def test_sigterm_ends_each_request_cleanly_after_the_grace_period(model_dir):
    """Requests still running when the grace period ends: streams get an error event and [DONE], the others a
    JSON 503 (--max-num-seqs 4 runs one n=4 request at a time, so most of them are still running)."""
    running = Server(model_dir, "--graceful-shutdown", "0.2", "--max-num-seqs", "4")
    body = {"model": "tiny", "prompt": "bye", "max_tokens": 240, "temperature": 0, "n": 4}

    def stream() -> list[str]:
        with httpx.stream("POST", f"{running.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            return [line for line in r.iter_lines() if line]

    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(stream) for _ in range(3)]
        plain = pool.submit(httpx.post, f"{running.url}/v1/completions", json=body, timeout=30)
        deadline = time.monotonic() + 20
        while sum(running.health()[k] for k in ("running", "waiting", "queued")) < 4 + 3:  # all four admitted
            assert time.monotonic() < deadline
            time.sleep(0.01)
        running.process.send_signal(signal.SIGTERM)
        results = [f.result(30) for f in streams]
        answer = plain.result(30)
    assert running.process.wait(30) == 0
    running.log.close()
    ended = 0
    for lines in results:
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        if "error" in events[-1]:
            assert events[-1]["error"]["code"] == "shutting_down"
            ended += 1
        else:
            assert all(c["finish_reason"] == "length" for c in events[-1]["choices"])
    if answer.status_code != 200:
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "shutting_down", answer.text
        ended += 1
    assert ended >= 3


def test_serve_loads_quantized_models(model_dir, tmp_path):
    """--quantize rtn quantizes at load; an AWQ checkpoint folder loads as int4 without --quantize."""
    import torch

    import hfaccel
    from hfaccel.tools.cli import build_parser
    from hfaccel.tools.serving import load_for_serving

    args = build_parser().parse_args(["serve", str(model_dir), "--quantize", "rtn", "--group-size", "32"])
    model, tokenizer = load_for_serving(args, torch.device("cpu"), torch.float32)
    assert any(isinstance(m, hfaccel.Int4Linear) for m in model.modules()) and tokenizer is not None
    hfaccel.save_quantized(model, tmp_path / "awq", format="awq", tokenizer=tokenizer)
    args = build_parser().parse_args(["serve", str(tmp_path / "awq")])
    loaded, _ = load_for_serving(args, torch.device("cpu"), torch.float16)
    assert any(isinstance(m, hfaccel.Int4Linear) for m in loaded.modules())
