"""The layout of the source: fastft's modules import each other without a cycle, and the main job's modules
(fastft.e2e) each import only the layers below them, in the order fastft/e2e/__init__.py lists them."""

import ast
import re
from pathlib import Path

import fastft.e2e

ROOT = Path(__file__).resolve().parent.parent


def _modules() -> dict[str, Path]:
    """Every module of fastft under its import name (kernels/ is fastft.kernels)."""
    found = {}
    for path in [*(ROOT / "fastft").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        parts = ["fastft", *parts] if parts[0] == "kernels" else parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known) -> set[str]:
    """The fastft modules ``name`` imports, at module level or inside functions (a package's own parents
    left out: importing a submodule runs them first anyway)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
            prefix = ".".join(base + [node.module] if node.module else base) if node.level else node.module
            targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name and not name.startswith(t + "."))
    return found


def test_no_import_cycles_in_fastft():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict = {}  # name -> "open" while its imports are walked, "done" after

    def walk(name, chain):
        if state.get(name) == "open":
            raise AssertionError("import cycle: " + " -> ".join(chain[chain.index(name) :] + [name]))
        if state.get(name) is None:
            state[name] = "open"
            for dep in sorted(graph[name]):
                walk(dep, chain + [name])
            state[name] = "done"

    for name in sorted(graph):
        walk(name, [])


def test_e2e_modules_import_only_the_layers_below():
    layers = re.findall(r"^- ``(\w+)``", fastft.e2e.__doc__, re.M)
    on_disk = sorted(p.stem for p in (ROOT / "fastft" / "e2e").glob("*.py") if p.stem != "__init__")
    assert sorted(layers) == on_disk, "fastft/e2e/__init__.py lists every module of the package"
    modules = _modules()
    for i, layer in enumerate(layers):
        name = f"fastft.e2e.{layer}"
        used = {m.split(".")[2] for m in _imports(name, modules[name], modules) if m.startswith("fastft.e2e.")}
        above = used - set(layers[:i])
        assert not above, f"fastft.e2e.{layer} imports {sorted(above)}, listed after it"
