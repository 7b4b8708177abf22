"""docs/architecture.md names every module of the package, each in its own package's part of the layer map, so
the map cannot silently fall behind the code."""

import re
from pathlib import Path

import hfaccel

PACKAGE = Path(hfaccel.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"


def layer_map_sections() -> dict[str, str]:
    """The layer map (the first code block) cut at each top-level entry (``kv/``, ``device.py``): name -> its lines."""
    block = ARCHITECTURE.read_text().split("```")[1]
    sections, current = {}, None
    for line in block.splitlines():
        entry = re.match(r"([a-z_]+)(?:/|\.py)\s", line)
        if entry:
            current = entry.group(1)
            sections[current] = ""
        if current is not None:
            sections[current] += line + "\n"
    return sections


def test_every_module_is_in_the_layer_map():
    sections = layer_map_sections()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:  # a top-level module is an entry of its own (the package's __init__ is the root)
            if path.stem not in sections and path.name != "__init__.py":
                missing.append(path.name)
        elif path.name != "__init__.py" and path.name not in sections.get(parts[0], ""):
            missing.append("/".join(parts))
    assert not missing, f"modules docs/architecture.md's layer map does not name: {missing}"


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_links_resolve():
    """Every ``docs/...md#anchor`` the README points to is a file with that heading."""
    readme = (PACKAGE.parent / "README.md").read_text()
    links = re.findall(r"(docs/[\w.-]+\.md)(?:#([\w-]+))?", readme)
    assert links, "the README links no docs page"
    broken = []
    for page, anchor in links:
        path = PACKAGE.parent / page
        if not path.exists():
            broken.append(page)
            continue
        headings = re.findall(r"^#+ (.+)$", path.read_text(), flags=re.MULTILINE)
        if anchor and anchor not in {_github_anchor(h) for h in headings}:
            broken.append(f"{page}#{anchor}")
    assert not broken, f"README links with no such page or heading: {broken}"


def test_readme_first_snippet_runs_as_pasted(capsys, monkeypatch):
    """The README's first snippet, run as a user runs it on a CPU (no Triton interpreter) with its hub name pointed
    at the offline SmolLM2 copy: it prints the continuation and what served the model, and restores the model."""
    from tests.assets import smollm2_or_skip

    monkeypatch.setenv("TRITON_INTERPRET", "0")

    readme = (PACKAGE.parent / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, flags=re.DOTALL).group(1)
    hub_name = 'name = "HuggingFaceTB/SmolLM2-135M-Instruct"'
    assert hub_name in snippet, "the first snippet no longer loads SmolLM2 by its hub name; update this test"
    namespace: dict = {}
    exec(compile(snippet.replace(hub_name, f"name = {str(smollm2_or_skip())!r}"), "README.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.startswith("The capital of France is") and "Paris" in printed
    assert "last call: transformers (the faster path on cpu" in printed  # print(model.hfaccel): the path, and why
    assert getattr(namespace["model"], "hfaccel", None) is None  # restore() took it back out
