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
