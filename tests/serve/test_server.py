"""``hfaccel serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client and raw HTTP.

The served model is a tiny random Llama with a one-character-per-token tokenizer (tests/models.py), on
hfaccel's torch kernels, so every request is cheap and stop strings always span several tokens.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.models import char_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class Server:
    """A ``hfaccel serve`` subprocess on a free loopback port."""

    def __init__(self, model_dir: Path, *extra: str):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
        self.log = open(model_dir / f"server-{self.port}.log", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hfaccel.tools.cli", "serve", str(model_dir), "--port", str(self.port),
             "--served-model-name", "tiny", "--attention", "torch", "--num-blocks", "512",
             "--max-num-seqs", "64", "--graceful-shutdown", "5", *extra],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (model_dir / f"server-{self.port}.log").read_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError("the server did not come up in 120 s")

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            health = self.health()
            if health["blocks_used"] == 0 and health["running"] == 0 and health["waiting"] == 0:
                return health
            time.sleep(0.05)
        raise AssertionError(f"the server did not return to idle: {self.health()}")

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(30)
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def server(model_dir):
    running = Server(model_dir, "--async-scheduling")  # the CUDA default, run on the CPU
    yield running
    assert running.stop() == 0


def _greedy(**kwargs):
    return {"model": "tiny", "temperature": 0, **kwargs}


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
    chunks = list(client.chat.completions.create(messages=messages, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **_greedy()))
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
        assert choice.text == free[:free.index(stop)] and choice.finish_reason == "stop"
        assert len(choice.logprobs.tokens) >= len(choice.text)
        assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    sampled = client.completions.create(model="tiny", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=3)
    assert [len(c.text) for c in sampled.choices] == [5, 5, 5]
    multi = client.completions.create(prompt=["ab", "cd"], max_tokens=3, n=2, **_greedy())
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True,
                                          top_logprobs=3, **_greedy())
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
]


@pytest.mark.parametrize("body, status, param", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/completions", content=body, timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    ok = server.client().completions.create(prompt="still here", max_tokens=3, **_greedy())
    assert len(ok.choices[0].text) == 3


def test_bad_chat_input(server):
    for body, status in [({"model": "tiny", "messages": []}, 400),
                         ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400),
                         ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
                         ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400)]:
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == status and "error" in response.json(), response.text


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
    for name in ("hfaccel_requests_total", "hfaccel_prompt_tokens_total", "hfaccel_generation_tokens_total",
                 "hfaccel_time_to_first_token_seconds_bucket", "hfaccel_inter_token_latency_seconds_bucket",
                 "hfaccel_queue_depth", "hfaccel_running_sequences", "hfaccel_kv_blocks_used",
                 "hfaccel_kv_blocks_free"):
        assert name in text, name
    assert 'hfaccel_requests_total{endpoint="/v1/completions",status="200"}' in text


@pytest.mark.slow
def test_200_concurrent_streams_from_another_process(server, tmp_path):
    prompts = ["the cat sat on", "hello world", "a", "once upon a time there was"]
    expected = {p: server.client().completions.create(prompt=p, max_tokens=16, **_greedy()).choices[0].text
                for p in prompts}
    out = tmp_path / "load.json"
    command = [sys.executable, "-m", "hfaccel.tools.bench.loadgen", "--url", f"{server.url}/v1", "--model", "tiny",
               "--requests", "200", "--concurrency", "200", "--max-tokens", "16", "--deadline", "240",
               "--out", str(out), *[arg for p in prompts for arg in ("--prompt", p)]]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    print(done.stdout)  # p50 / p99 latency and TTFT
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["summary"]["ok"] == 200
    for result in results["results"]:
        assert result["text"] == expected[result["prompt"]] and result["finish_reason"] == "length"
    assert server.wait_idle()["blocks_used"] == 0


@pytest.fixture(scope="module")
def guarded(model_dir):
    running = Server(model_dir, "--api-key", "sesame", "--max-queue", "2", "--request-timeout", "0.3")
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
        with http.stream("POST", f"{guarded.url}/v1/completions", json=body) as first, \
                http.stream("POST", f"{guarded.url}/v1/completions", json=body) as second:
            assert first.status_code == second.status_code == 200
            start = time.monotonic()
            third = http.post(f"{guarded.url}/v1/completions", json={**body, "stream": False})
            assert third.status_code == 429 and time.monotonic() - start < 5
            assert third.json()["error"]["type"] == "rate_limit_error"
    guarded.wait_idle()


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


def test_serve_loads_quantized_models(model_dir, tmp_path):
    """--quantize rtn quantizes at load; an AWQ checkpoint folder loads as int4 without --quantize."""
    import torch

    import hfaccel
    from hfaccel.tools.cli import build_parser, load_for_serving

    args = build_parser().parse_args(["serve", str(model_dir), "--quantize", "rtn", "--group-size", "32"])
    model, tokenizer = load_for_serving(args, torch.device("cpu"), torch.float32)
    assert any(isinstance(m, hfaccel.Int4Linear) for m in model.modules()) and tokenizer is not None
    hfaccel.save_quantized(model, tmp_path / "awq", format="awq", tokenizer=tokenizer)
    args = build_parser().parse_args(["serve", str(tmp_path / "awq")])
    loaded, _ = load_for_serving(args, torch.device("cpu"), torch.float16)
    assert any(isinstance(m, hfaccel.Int4Linear) for m in loaded.modules())
