"""Wheels of what the test suite needs and a lent GPU machine lacks, resolved from the wheels' own metadata.

The GPU machines have no network (docs/benchmarks.md "Running on a lent GPU"): the packages the suite needs beyond
their image travel as wheels. Starting from hfaccel's own requirements (``pyproject.toml``: dependencies and the
``dev`` and ``serve`` extras), each package that image lacks is downloaded (``pip download --no-deps`` for the
machine's Python and platform) and its ``Requires-Dist`` entries — those whose markers hold there — are followed
in turn, so nothing a new release starts to need (openai's ``httpx2``, fastapi's ``opentelemetry``...) is missed.

    python -m hfaccel.tools.gpu_wheels wheels/      # then carry wheels/ and `make gpu-test` there
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# the GPU machines' image (KINDS.md in the device library, read 2026-11-17): never carried
PRESENT = frozenset(
    canonicalize_name(name)
    for name in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()
)
# too large to carry (the tree that travels is at most 64 MiB): the tests that need it skip
LEFT_OUT = {"bitsandbytes": "its CUDA wheel is larger than what a device call carries; its tests skip"}
# the GPU machines' interpreter and platform (Python 3.12, x86-64 Linux)
TARGET = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
PIP_TARGET = [
    "--python-version",
    "3.12",
    "--implementation",
    "cp",
    "--only-binary=:all:",
    *[arg for n in (17, 24, 27, 28, 31, 34, 35) for arg in ("--platform", f"manylinux_2_{n}_x86_64")],
    "--platform",
    "manylinux2014_x86_64",
    "--platform",
    "any",
]


def project_requirements(pyproject: Path, extras: Iterable[str] = ("dev", "serve")) -> list[Requirement]:
    """hfaccel's dependencies and the requirements of ``extras`` — and of the extras they name in turn
    (``hfaccel[serve,structured]`` in ``dev``) — not hfaccel itself."""
    import tomllib  # Python >= 3.11, as where the wheels are prepared

    project = tomllib.loads(pyproject.read_text())["project"]
    own = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    reqs, pending, seen = [Requirement(spec) for spec in project["dependencies"]], list(extras), set()
    while pending:
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, optional.get(extra, [])):
            if canonicalize_name(req.name) == own:
                pending += sorted(req.extras)
            else:
                reqs.append(req)
    return reqs


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The ``Requires-Dist`` entries of a wheel whose markers hold on the GPU machine (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    requirements = [Requirement(spec) for spec in metadata.get_all("Requires-Dist") or []]
    return [req for req in requirements if req.marker is None or req.marker.evaluate(TARGET)]


def resolve(roots: Iterable[Requirement], download: Callable[[Requirement], Path]) -> dict[str, Path]:
    """Wheels (by canonical name) of every package reachable from ``roots`` that the GPU image lacks."""
    wheels: dict[str, Path] = {}
    queue = list(roots)
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in PRESENT or name in LEFT_OUT or name in wheels:
            continue
        wheels[name] = download(req)
        queue += wheel_requirements(wheels[name])
    return wheels


def pip_download(dest: Path) -> Callable[[Requirement], Path]:
    """A downloader: the newest wheel matching a requirement for the GPU machine, into ``dest``."""

    def download(req: Requirement) -> Path:
        spec = f"{req.name}{req.specifier}"
        before = set(dest.glob("*.whl"))
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), *PIP_TARGET, spec]
        subprocess.run(command, check=True)
        new = set(dest.glob("*.whl")) - before
        matching = [
            w
            for w in new or dest.glob("*.whl")
            if canonicalize_name(w.name.split("-")[0]) == canonicalize_name(req.name)
        ]
        if not matching:
            raise RuntimeError(f"pip downloaded no wheel for {spec} into {dest}")
        return matching[0]

    return download


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    dest = Path(args[0] if args else "wheels")
    dest.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[2]
    wheels = resolve(project_requirements(root / "pyproject.toml"), pip_download(dest))
    for name, reason in LEFT_OUT.items():
        print(f"left out {name}: {reason}")
    size = sum(w.stat().st_size for w in wheels.values())
    print(f"{len(wheels)} wheels, {size / (1 << 20):.1f} MiB in {dest}: {', '.join(sorted(wheels))}")
    print(copy_tokenizer(dest / TOKENIZER_DIR))
    return 0


TOKENIZER_DIR = "smollm2-tokenizer"  # beside the wheels: `bench structured --tokenizer wheels/smollm2-tokenizer`
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(dest: Path) -> str:
    """SmolLM2's tokenizer files alone (3.4 MiB; its weights do not fit the carried tree) into ``dest``, from the
    assets cache; says what it did."""
    from hfaccel.tools.assets import cached_smollm2

    source = cached_smollm2()
    if source is None:
        return "SmolLM2 is not in the assets cache (make assets): no tokenizer copied for bench structured"
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)
    return f"SmolLM2's tokenizer in {dest} (bench structured --tokenizer {dest})"


if __name__ == "__main__":
    raise SystemExit(main())
