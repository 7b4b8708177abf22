"""``hfaccel serve --tensor-parallel-size 2`` on the CPU (gloo): the server starts its two ranks itself, answers the
``openai`` client with the single-process server's greedy text, stops with an error when a rank dies mid-run, and
stops both ranks on SIGTERM; under ``torchrun`` (its two ranks, its supervision) it answers the same. Each server is
bounded in time (tests.serve.test_server.Server waits 120 s at most to come up; every wait here has a limit)."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from tests.helpers import CHAT_TEMPLATE, Server
from tests.models import char_tokenizer, tiny_model

TP = ("--tensor-parallel-size", "2")
PROMPTS = ["the cat", "a b c d e f"]
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("served-tp")
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def expected(model_dir) -> dict:
    """The single-process server's texts."""
    single = Server(model_dir)
    try:
        return _texts(single)
    finally:
        assert single.stop() == 0


def _texts(server: Server) -> dict:
    """Greedy completions (streamed and not) and a chat completion."""
    client = server.client()
    out = {}
    for prompt in PROMPTS:
        full = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True)
        out[prompt] = (full.choices[0].text, "".join(c.choices[0].text for c in chunks))
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
    out["chat"] = (chat.choices[0].message.content, "".join(c.choices[0].delta.content or "" for c in chunks))
    return out


def _ranks(server: Server) -> tuple[psutil.Process, psutil.Process]:
    """(rank 0: the process listening on the server's port, rank 1) among the server's spawned processes."""
    spawned = [
        p
        for p in psutil.Process(server.process.pid).children()
        if "multiprocessing.spawn" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert len(spawned) == 2, [p.cmdline() for p in spawned]
    listening = [
        p
        for p in spawned
        if any(c.laddr.port == server.port and c.status == psutil.CONN_LISTEN for c in p.net_connections())
    ]
    assert len(listening) == 1
    leader = listening[0]
    return leader, next(p for p in spawned if p.pid != leader.pid)


def _gone(processes, timeout: float) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return not alive


def test_tp_server_answers_like_one_process_and_sigterm_stops_both_ranks(model_dir, expected):
    server = Server(model_dir, *TP)
    try:
        ranks = _ranks(server)
        got = _texts(server)
        assert server.health()["status"] == "ok"
    except BaseException:
        server.process.kill()
        raise
    started = time.monotonic()
    assert server.stop() == 0, server.log_path.read_text()
    assert _gone(ranks, timeout=10), "a rank outlived the server"
    assert time.monotonic() - started < 30
    for key, (full, streamed) in got.items():
        assert full == streamed == expected[key][0], key
    assert sum(len(full) for full, _ in got.values()) > 20  # not all ended at once (EOS)


def test_a_rank_killed_mid_run_stops_the_server_with_an_error(model_dir):
    server = Server(model_dir, *TP)
    try:
        leader, follower = _ranks(server)
        first_chunk, errors = threading.Event(), []

        def stream() -> None:  # streams, one after another, until the server goes away
            try:
                while True:
                    for _ in server.client().completions.create(
                        model="tiny", prompt="abc", max_tokens=200, temperature=0, stream=True
                    ):
                        first_chunk.set()
            except Exception as error:
                errors.append(error)
            finally:
                first_chunk.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert first_chunk.wait(60)
        follower.kill()
        killed = time.monotonic()
        code = server.process.wait(30)
        elapsed = time.monotonic() - killed
        client.join(30)
        assert errors, "the client's streams went on"
    finally:
        if server.process.poll() is None:
            server.process.kill()
        server.log.close()
    log = server.log_path.read_text()
    assert code != 0, log
    assert "tensor-parallel rank 1 of 2 failed: its process exited (signal SIGKILL)" in log, log
    assert elapsed < 15, f"the server took {elapsed:.1f} s to stop"
    assert _gone([leader], timeout=5), "rank 0 outlived the server"


def test_under_torchrun_the_ranks_serve_like_one_process_and_sigterm_stops_them(model_dir, expected):
    """``torchrun --standalone --nproc-per-node 2 -m hfaccel.tools.cli serve ...``: the server takes torchrun's two
    ranks (no --tensor-parallel-size needed), rank 0 answers as one process does, and SIGTERM to torchrun stops
    both."""
    server = Server(model_dir, launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])
    try:
        workers = [p for p in psutil.Process(server.process.pid).children() if "hfaccel.tools.cli" in p.cmdline()]
        assert len(workers) == 2, [p.cmdline() for p in workers]
        got = _texts(server)
        assert server.health()["status"] == "ok"
    except BaseException:
        for process in psutil.Process(server.process.pid).children(recursive=True) + [server.process]:
            process.kill()
        raise
    server.stop()  # torchrun exits with its own code on a signal
    assert _gone(workers, timeout=15), "a rank outlived torchrun"
    for key, (full, streamed) in got.items():
        assert full == streamed == expected[key][0], key
