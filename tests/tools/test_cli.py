"""The hfaccel command: demo on a user's model folder, generate, and bench on CPU (small)."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from hfaccel.tools.bench import engine as engine_bench
from hfaccel.tools.cli import build_parser, main
from tests.assets import smollm2_or_skip
from tests.models import tiny_model
from tests.helpers import word_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama")
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    word_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


def test_demo_on_a_local_model(model_dir, capsys):
    assert (
        main(["demo", "--model", str(model_dir), "--prompt", "a b c", "--prompt", "d e", "--max-new-tokens", "6"]) == 0
    )
    out = capsys.readouterr().out
    assert "identical" in out and "tokens/s" in out and "transformers (sdpa)" in out and "vs transformers" in out
    assert "served by: decode loop hfaccel; attention" in out


def test_demo_says_when_both_rows_run_transformers_path(model_dir, capsys, monkeypatch):
    """On a CPU as a user has it (no Triton), auto keeps transformers' own path: no speed ratio, the paths that do
    differ named instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert main(["demo", "--model", str(model_dir), "--prompt", "a b c", "--max-new-tokens", "4"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "same path" in out and "both rows ran the same path as transformers on this device" in out, out
    assert "--compile true" in out and "identical" in out


def test_demo_with_compile_on_a_cpu(model_dir, capsys, monkeypatch, recompile_limit_per_model):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU as a user has it
    assert (
        main(["demo", "--model", str(model_dir), "--prompt", "a b c", "--max-new-tokens", "6", "--compile", "true"])
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "identical" in out and "compile=True: its static cache and compiled forward" in out, out
    assert "same path" not in out  # a ratio: the compiled path is not transformers' eager one


def test_generate_prints_text(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--max-new-tokens", "4", "a b c"]) == 0
    assert capsys.readouterr().out.strip()


def test_bench_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the command's plumbing, on the torch path (kernels: tests/kernels)
    monkeypatch.setattr(engine_bench, "DECODE_BATCH", 3)  # the engine's decode-step table at CPU sizes (not 64 x 1024)
    monkeypatch.setattr(engine_bench, "DECODE_CONTEXTS", (24, 40))
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "attention",
                "paged",
                "memory",
                "decode",
                "engine",
                "--model",
                "tiny-llama",
                "--batch",
                "1",
                "--batch",
                "2",
                "--prompt-len",
                "8",
                "--new-tokens",
                "3",
                "--requests",
                "6",
                "--profile",
                "--kv-cache-dtype",
                "fp8",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    results = json.loads(output.read_text())
    assert {"environment", "attention", "paged", "memory", "decode", "engine"} <= results.keys()
    assert {row["path"] for row in results["decode"]} == {
        "transformers sdpa",
        "hfaccel",
        "hfaccel compile=False",
        "hfaccel compile=True",
    }
    assert all(
        row["kv_gb_per_s"] > 0 and row["copy_gb_per_s"] > 0 and row["read_gb_per_s"] > 0 and row["num_splits"] >= 1
        for row in results["paged"]
    )
    assert {row["config_from"] for row in results["paged"]} == {"heuristics"}  # fp32: never the tuned tables'
    assert all(row["fraction_of_read"] > 0 and row["read_gb_per_s"] > 0 for row in results["attention"])
    memory = {row["cache"]: row["bytes"] for row in results["memory"]}
    assert memory["real tokens (no padding)"] <= memory["hfaccel pool held at most"] <= memory["hfaccel pool allocated"]
    assert memory["real tokens (no padding)"] < memory["transformers DynamicCache"]
    assert all(row["tokens_per_s"] > 0 and 0 < row["pct_roofline"] for row in results["decode"])
    assert [(row["batch"], row["rows"].split()[0]) for row in results["decode_sampler"]] == [
        (1, "greedy"),
        (1, "seeded"),
        (1, "seeded,"),
        (2, "greedy"),
        (2, "seeded"),
        (2, "seeded,"),
    ]
    assert all(row["sample_ms"] > 0 and row["share_of_step"] > 0 for row in results["decode_sampler"])
    kernels = results["decode_kernels"]  # --profile: hfaccel's step by kernel (here the CPU's ops), at each batch
    assert {row["batch"] for row in kernels} == {1, 2} and all(0 < row["share_of_step"] <= 1 for row in kernels)
    assert any(row["kernel"] == "aten::mm" and row["calls_per_step"] >= 1 for row in kernels if row["batch"] == 1)
    assert all(
        row["hfaccel_tflops"] > 0 and row["sdpa_tflops"] > 0 and row["routed_ms"] > 0 for row in results["attention"]
    )
    assert {row["routed_path"] for row in results["attention"]} == {"sdpa"}  # hfaccel's kernels do not run here
    assert "prefill attention" in capsys.readouterr().out
    paths = {row["path"]: row for row in results["engine"]}
    assert paths["hfaccel Engine"]["output_tokens"] == paths["padded static batches of 32"]["output_tokens"]
    assert all(row["tokens_per_s"] > 0 for row in results["engine"])
    fp8 = [row for path, row in paths.items() if path.startswith("hfaccel Engine, fp8 KV cache")]
    assert len(fp8) == 1 and fp8[0]["output_tokens"] == paths["hfaccel Engine"]["output_tokens"]
    assert paths["hfaccel Engine"]["ttft_p50_ms"] > 0
    assert paths["transformers generate_batch (defaults)"]["vs_generate_batch"] == 1
    decode_steps = results["engine_decode_step"]
    assert [(row["batch"], row["context"]) for row in decode_steps] == [(3, 24), (3, 40)]
    assert all(row["step_ms"] > 0 for row in decode_steps)


def test_bench_engine_host_splits_the_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    output = tmp_path / "bench.json"
    assert main(["bench", "engine", "--host", "--model", "tiny-llama", "--batch", "2", "--output", str(output)]) == 0
    (row,) = json.loads(output.read_text())["engine_host"]
    parts = ("scheduling_ms", "metadata_ms", "launch_ms", "waiting_ms", "detokenizing_ms")
    assert row["batch"] == 2 and row["steps"] >= 64 and row["generate_step_ms"] > 0
    assert all(row[part] >= 0 for part in parts) and row["metadata_ms"] > 0 and row["launch_ms"] > 0
    assert sum(row[part] for part in parts) + row["other_ms"] == pytest.approx(row["step_ms"])


@pytest.mark.slow
def test_bench_engine_over_two_ranks_reports_the_all_reduce_share(tmp_path, monkeypatch):
    """bench engine --tensor-parallel-size 2 on the CPU (gloo): the engine serves the workload over two ranks, and
    the decode step and its collectives are timed."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "engine",
                "--model",
                "tiny-llama",
                "--device",
                "cpu",
                "--tensor-parallel-size",
                "2",
                "--requests",
                "4",
                "--batch",
                "3",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    (row,) = json.loads(output.read_text())["engine_tp"]
    assert (row["ranks"], row["backend"], row["batch"]) == (2, "gloo", 3)
    assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["all_reduce_ms"] > 0
    assert row["all_reduce_share"] == pytest.approx(row["all_reduce_ms"] / row["step_ms"])


@pytest.mark.slow
def test_bench_speculative(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "speculative",
                "--batch",
                "1",
                "--batch",
                "2",
                "--prompt-len",
                "16",
                "--new-tokens",
                "8",
                "--draft",
                "self",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    rows = json.loads(output.read_text())["speculative"]
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["alpha"] == 1.0 and row["acceptance_rate"] == 1.0 for row in rows)  # the target drafts itself
    assert all(row["expected_speedup"] > 0 and row["efficiency"] > 0 for row in rows)


def test_bench_int4(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the command's plumbing, on the torch path (kernels: tests/kernels)
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "int4",
                "--batch",
                "1",
                "--batch",
                "2",
                "--prompt-len",
                "8",
                "--new-tokens",
                "3",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    results = json.loads(output.read_text())
    kernels, decode = results["int4_kernels"], results["int4_decode"]
    assert [(row["k"], row["n"], row["m"]) for row in kernels] == [(256, 384, 1), (256, 384, 16)]
    assert all(row["int4_us"] > 0 and row["cublas_us"] > 0 and row["int4_gb_per_s"] > 0 for row in kernels)
    assert [(row["weights"], row["batch"]) for row in decode] == [
        ("float32", 1),
        ("float32", 2),
        ("int4 rtn g128", 1),
        ("int4 rtn g128", 2),
    ]
    assert all(row["tokens_per_s"] > 0 and row["weight_gb"] > 0 for row in decode)
    assert decode[2]["weight_gb"] < decode[0]["weight_gb"] / 3  # int4 layers hold ~1/7 of the fp32 bytes


def test_bench_fp8(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the command's plumbing, on the torch path (kernels: tests/kernels)
    output = tmp_path / "bench.json"
    assert (
        main(["bench", "fp8", "--batch", "1", "--prompt-len", "8", "--new-tokens", "3", "--output", str(output)]) == 0
    )
    results = json.loads(output.read_text())
    kernels, decode = results["fp8_kernels"], results["fp8_decode"]
    assert [(row["m"], row["path"]) for row in kernels] == [(1, "torch reference"), (16, "torch reference")]
    assert all(row["fp8_us"] > 0 and row["cublas_us"] > 0 for row in kernels)
    assert [row["weights"] for row in decode] == ["float32", "fp8 e4m3 per channel"]
    assert decode[1]["weight_gb"] < decode[0]["weight_gb"] / 2  # fp8 layers hold 1/4 of the fp32 bytes


def test_bench_vlm(tmp_path, monkeypatch):
    """The VLM case's plumbing on its tiny model: decode rows of each path that ran, the serving comparison."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "vlm",
                "--model",
                "tiny",
                "--requests",
                "3",
                "--batch",
                "2",
                "--new-tokens",
                "3",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    results = json.loads(output.read_text())
    assert [row["path"] for row in results["vlm_decode"]] == ["transformers sdpa", "hfaccel"]
    serve = results["vlm_serve"]
    assert [row["path"] for row in serve] == ["transformers generate (padded batches of 2)", "hfaccel Engine"]
    assert all(row["output_tokens_per_s"] > 0 and row["requests"] == 3 for row in serve)


def test_bench_structured(tmp_path, monkeypatch):
    """Mask times over real constrained generations and the 0 / 50 / 100% structured throughput rows (a tiny random
    model over SmolLM2's tokenizer files alone, as a GPU machine without the assets gets them, a few tokens)."""
    smollm2 = smollm2_or_skip()
    pytest.importorskip("xgrammar")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smollm2) / name, tokenizer / name)
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "structured",
                "--device",
                "cpu",
                "--model",
                "tiny-llama",
                "--tokenizer",
                str(tokenizer),
                "--requests",
                "2",
                "--new-tokens",
                "3",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    results = json.loads(output.read_text())
    masks, rows = results["structured_masks"], results["structured_throughput"]
    assert masks[-1]["spec"] == "all" and {"choice", "json_object", "regex: phone number"} < {m["spec"] for m in masks}
    assert all(m["tokens"] > 0 and 0 < m["p50_us"] <= m["p99_us"] for m in masks)
    assert all(m["compile_ms"] > 0 for m in masks[:-1])
    assert [(r["structured_pct"], r["structured"]) for r in rows] == [(0, 0), (50, 1), (100, 2)]
    assert all(r["output_tokens"] == 2 * 3 and r["tokens_per_s"] > 0 for r in rows)  # fixed lengths
    assert rows[0]["vs_unconstrained"] == 1 and rows[0]["mask_ms_per_step"] < rows[2]["mask_ms_per_step"]


def test_bench_lora(tmp_path, monkeypatch):
    """The four serving rows (base engine; the LoRA engine on base requests, one adapter, 8 adapters mixed) and the
    kernels' time per decode step, on tiny-llama with 8 random rank-16 PEFT adapters, a few tokens."""
    pytest.importorskip("peft")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    output = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "lora",
                "--device",
                "cpu",
                "--model",
                "tiny-llama",
                "--batch",
                "3",
                "--prompt-len",
                "4",
                "--new-tokens",
                "2",
                "--output",
                str(output),
            ]
        )
        == 0
    )
    results = json.loads(output.read_text())
    rows, kernels, config = results["lora_throughput"], results["lora_kernels"], results["lora_config"]
    assert [(row["path"], row["adapters"]) for row in rows] == [
        ("base model, no LoRA engine", 0),
        ("LoRA engine, base requests", 0),
        ("LoRA engine, 1 adapter", 1),
        ("LoRA engine, 8 adapters mixed", 3),
    ]  # 3 requests: 3 of the 8 adapters
    assert all(row["output_tokens"] == 3 * 2 and row["tokens_per_s"] > 0 and row["steps"] == 2 for row in rows)
    assert rows[0]["vs_base"] == 1 and (config["adapters"], config["rank"], config["wrapped_layers"]) == (8, 16, 28)
    assert [k["layers"] for k in kernels] == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "all",
    ]
    assert kernels[-1]["count"] == 28 and all(k["ms_per_step"] > 0 and k["vs_base_step"] > 0 for k in kernels)
    assert all(k["base_step_ms"] == rows[0]["step_ms"] for k in kernels)


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--attention", "cuda"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("method, fmt", [("rtn", "awq"), ("gptq", "gptq")])
def test_quantize_command_writes_a_loadable_checkpoint(model_dir, tmp_path, method, fmt):
    import hfaccel

    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{i % 90 + 4}" for i in range(400)))
    out = tmp_path / "q"
    args = [
        "quantize",
        str(model_dir),
        "--method",
        method,
        "--out",
        str(out),
        "--group-size",
        "32",
        "--samples",
        "4",
        "--seq-len",
        "16",
        "--calib",
        str(text),
        "--device",
        "cpu",
    ]
    assert main(args) == 0
    model = hfaccel.load_quantized(out, dtype=torch.float16)
    assert any(isinstance(m, hfaccel.Int4Linear) for m in model.modules())
    assert (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists()


def test_bench_unknown_case_and_serve_without_extras_message():
    with pytest.raises(SystemExit, match="unknown case\\(s\\) \\['nope'\\]"):
        main(["bench", "nope"])
    args = build_parser().parse_args(["serve", "folder", "--api-key", "k", "--max-queue", "3"])
    assert (args.host, args.port, args.api_key, args.max_queue) == ("127.0.0.1", 8000, "k", 3)


def test_the_generate_batch_baseline_takes_its_fastest_settings_on_cuda():
    """bench engine compares against transformers' continuous batching at its fastest settings the installed
    release offers (CUDA graphs, async batching, compile) on CUDA, and says which; elsewhere its defaults."""
    from hfaccel import compat

    config, settings = compat.continuous_batching_config(64, 16, 512, fastest=True)
    assert "use_cuda_graph=True" in settings and config.use_cuda_graph is True and config.num_blocks == 64
    assert config.default_compile_level == 1 and config.use_async_batching is True
    assert compat.continuous_batching_config(64, 16, 512)[1] == "defaults"
