"""Helpers several test modules share: a ``hfaccel serve`` process, the engine's greedy workloads and their
references, a word-level tokenizer and a small Llama for quantization tests."""

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from hfaccel.engine import SamplingParams
from hfaccel.serve.http import wait_until_serving
from tests.devices import DEVICE

ROOT = Path(__file__).resolve().parents[1]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


class Server:
    """A ``hfaccel serve`` subprocess on a loopback port the system picks (``--port 0``); its output goes to
    :attr:`log_path`."""

    def __init__(self, model_dir: Path, *extra: str, launcher: Sequence[str] = (), env: dict[str, str] | None = None):
        """``hfaccel serve model_dir *extra``, run by ``python *launcher -m hfaccel.tools.cli`` (e.g. torchrun's
        module and options); ``env``: variables added to its environment (``PYTHONPATH`` entries go after the
        repository's)."""
        self.model_dir = model_dir
        extra_env = dict(env or {})
        path = os.pathsep.join([str(ROOT)] + ([extra_env.pop("PYTHONPATH")] if "PYTHONPATH" in extra_env else []))
        env = {**os.environ, "TRITON_INTERPRET": "0", **extra_env, "PYTHONPATH": path}
        descriptor, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=model_dir)
        self.log_path = Path(name)
        self.log = os.fdopen(descriptor, "w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                *launcher,
                "-m",
                "hfaccel.tools.cli",
                "serve",
                str(model_dir),
                "--port",
                "0",
                "--served-model-name",
                "tiny",
                "--attention",
                "torch",
                "--num-blocks",
                "512",
                "--max-num-seqs",
                "64",
                "--graceful-shutdown",
                "5",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            self.url = wait_until_serving(self.process, self.log_path, timeout=120)
        except RuntimeError:
            self.process.kill()
            self.log.close()
            raise
        self.port = int(self.url.rsplit(":", 1)[1])

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

    def ended_by(self, request: Callable[[], object], error: str, timeout: float = 60.0) -> str:
        """``request()`` ends the server's engine: it gets a 503 naming ``error``, and the server exits by itself
        with status 1 within ``timeout`` seconds (else it is stopped). Returns the server's log."""
        try:
            with pytest.raises(openai.InternalServerError, match=error) as caught:
                request()
            assert caught.value.status_code == 503
        finally:
            try:
                status = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                status = self.stop()
            self.log.close()
        assert status == 1
        return self.log_path.read_text()


SHARED = list(range(30, 50))  # a 20-token prefix several prompts share (one full block of 16)


def mixed_prompts(count: int = 20, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1-29 tokens (some sharing SHARED as prefix) and max_tokens of 1-24."""
    rng = random.Random(seed)
    prompts, budgets = [], []
    for i in range(count):
        tail = [rng.randrange(3, 96) for _ in range(rng.randrange(1, 16 if i % 3 == 0 else 30))]
        prompts.append(SHARED + tail if i % 3 == 0 else tail)
        budgets.append(rng.randrange(1, 25))
    return prompts, budgets


def reference(model, prompts, budgets) -> list[list[int]]:
    """Each prompt's own greedy generate() (no EOS: fixed lengths)."""
    outs = []
    for prompt, budget in zip(prompts, budgets):
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=budget,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def greedy(budget: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True, **kwargs)


def run(engine, prompts, budgets):
    return engine.generate(prompts, [greedy(b) for b in budgets])


def word_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny model's vocabulary (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    vocab.update({chr(ord("a") + i): 4 + i for i in range(26)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


QUANT_LLAMA = dict(
    vocab_size=96,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
)


def quant_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **extra) -> transformers.PreTrainedModel:
    """A small random Llama whose Linear shapes suit every int4 group size (128 / 256 features)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**QUANT_LLAMA, **extra})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval().to(DEVICE)
