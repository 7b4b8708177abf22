"""The package's layout rule (docs/architecture.md): imports run one way, from the tools down to the kernels.

Layers, lowest first — a package may import only from layers below its own (and within itself):

    kernels < compat, device < kv, quant < attention, lora < sampling < runner < distributed < engine, speculative <
    serve, hf < tools

Packages in one layer do not import each other. Only ``tools`` reads the ``hfaccel`` package root (the public
API); everything else names the module it needs. Function-level (lazy) imports count too.
"""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import hfaccel

PACKAGE = Path(hfaccel.__file__).parent
LAYERS = [
    {"kernels"},
    {"compat", "device"},
    {"kv", "quant"},
    {"attention", "lora"},
    {"sampling"},
    {"runner"},
    {"distributed"},
    {"engine", "speculative"},
    {"serve", "hf"},
    {"tools"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The hfaccel module an import names (``from hfaccel import compat`` names ``hfaccel.compat``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported hfaccel module, line, at module level) of every import in the file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(anchor[: len(anchor) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "hfaccel" or name.startswith("hfaccel."):
                found.append((_resolve(name, modules), node.lineno, id(node) in top_level))
    return found


def _part(module: str) -> str | None:
    """The layer part of a module (``hfaccel.kv.pool`` -> ``kv``); None for the package root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_belongs_to_a_layer():
    unplaced = sorted({_part(m) for m in _modules()} - set(RANK) - {None})
    assert not unplaced, f"modules outside every layer: {unplaced}; place them in LAYERS (and the docs)"


def test_imports_run_one_way():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        part = _part(module)
        if part is None:
            continue  # the package root gathers the public API
        for target, line, _ in _imports(module, path, modules):
            target_part = _part(target)
            if target_part == part:
                continue
            if target_part is None:
                if part != "tools":
                    wrong.append(f"{module}:{line} imports the hfaccel root (only tools may)")
            elif RANK[target_part] >= RANK[part]:
                wrong.append(f"{module}:{line} imports {target} ({part} may import only layers below it)")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    modules = _modules()
    graph = {m: {t for t, _, top in _imports(m, p, modules) if top and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if state.get(nxt) is None:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(graph):
        if state.get(module) is None:
            visit(module)


def test_accelerate_loads_neither_the_engine_nor_the_server_nor_the_tools_nor_peft():
    script = textwrap.dedent("""
        import sys
        import torch, transformers
        import hfaccel
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1)
        model = hfaccel.accelerate(transformers.LlamaForCausalLM(config).eval(), attention="torch")
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
        print(sorted(m for m in sys.modules if m.split(".")[:2] in (["hfaccel", "engine"], ["hfaccel", "serve"],
                                                                   ["hfaccel", "tools"])
                     or m.split(".")[0] == "peft"))  # peft (optional) only for a PEFT model
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=PACKAGE.parent
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


MAX_MODULE_LINES = 500  # a module one reads whole; kernels keep their launcher and reference beside the kernel


def test_no_module_outgrows_a_read():
    """Every module of the package but a kernel's fits in ``MAX_MODULE_LINES`` lines: a module that grows past it
    holds more than one concern and is split along them."""
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent.name != "kernels" and (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
