"""The GPU machine's wheels: resolved from the wheels' own Requires-Dist, for the GPU machine's Python."""

import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from transformers import AutoTokenizer

from hfaccel.tools import gpu_wheels
from tests.assets import smollm2_or_skip

METADATA = {
    "openai": ["httpx2>=2", "jiter", "numpy; extra == 'datalib'", "tomli; python_version < '3.11'", "pydantic"],
    "httpx2": ["httpcore2", "anyio", "truststore; python_version >= '3.10'"],
    "pydantic": ["typing-extensions"],
    "httpcore2": [],
    "jiter": [],
    "truststore": [],
}


def _wheel(folder: Path, name: str) -> Path:
    path = folder / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"]
    lines += [f"Requires-Dist: {spec}" for spec in METADATA[name]]
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_requirements_are_followed_through_the_wheels_metadata(tmp_path):
    asked = []

    def download(req: Requirement) -> Path:
        asked.append(str(req))
        return _wheel(tmp_path, req.name)

    roots = [Requirement("openai>=1.30"), Requirement("bitsandbytes>=0.45"), Requirement("torch>=2.5")]
    wheels = gpu_wheels.resolve(roots, download)
    # numpy (an extra's), tomli (another Python's), anyio and typing-extensions (on the machine), bitsandbytes
    # (left out) and torch (on the machine) are not fetched; what openai's dependencies need is
    assert sorted(wheels) == ["httpcore2", "httpx2", "jiter", "openai", "pydantic", "truststore"]
    assert asked[0] == "openai>=1.30" and "httpx2>=2" in asked


def test_the_roots_are_the_projects_own_requirements():
    root = Path(gpu_wheels.__file__).resolve().parents[2]
    names = {req.name for req in gpu_wheels.project_requirements(root / "pyproject.toml")}
    assert {"fastapi", "uvicorn", "openai", "pytest", "gguf", "torch"} <= names and "hfaccel" not in names
    assert {"xgrammar", "peft"} <= names  # dev's hfaccel[serve,structured] followed: structured's xgrammar


def test_the_tokenizer_for_bench_structured_travels_without_the_weights(tmp_path):
    smollm2_or_skip()
    assert "--tokenizer" in gpu_wheels.copy_tokenizer(tmp_path / "tok")
    assert sorted(p.name for p in (tmp_path / "tok").iterdir()) == sorted(gpu_wheels.TOKENIZER_FILES)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "tok")) > 49000
