"""The README and docs/ stay true: every Python example in them runs as written, each in a fresh interpreter, on
this machine's device (a CPU in CI: the examples are device-neutral); the README's headline table is what
scripts/readme_numbers.py renders from the recorded runs; docs/reference.md names every public name.

An example that cannot run here (it downloads weights, or needs several GPUs) has the line
``<!-- not run: why -->`` right above its fence, and is skipped with that reason."""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?:<!-- not run: (?P<why>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```", flags=re.S | re.M)
BLOCKS = [
    (page.relative_to(ROOT).as_posix(), i, m["code"], m["why"])
    for page in PAGES
    for i, m in enumerate(FENCE.finditer(page.read_text()))
]
# Optional packages an example may import: it is skipped where one is missing.
OPTIONAL = ("transformers", "peft", "accelerate", "trl", "datasets", "tokenizers", "liger_kernel", "hypothesis")


def test_the_readme_and_docs_have_examples():
    pages = {page for page, *_ in BLOCKS}
    assert sum(page == "README.md" for page, *_ in BLOCKS) >= 1
    assert {"docs/reference.md", "docs/transformers.md", "docs/fuzzing.md"} <= pages


@pytest.mark.parametrize("page, index, code, why", BLOCKS, ids=[f"{p}:block{i}" for p, i, *_ in BLOCKS])
def test_example_runs(page, index, code, why, tmp_path):
    if why:
        pytest.skip(why)
    for name in OPTIONAL:
        if re.search(rf"^\s*(import|from) {name}\b", code, flags=re.M):
            pytest.importorskip(name)
    if "Trainer" in code:
        pytest.importorskip("accelerate")
    # As a user runs it: from another folder, without the test suite's TRITON_INTERPRET.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900
    )
    assert out.returncode == 0, f"{page} block {index} failed:\n{code}\n{out.stdout}\n{out.stderr}"


def _readme_numbers():
    spec = importlib.util.spec_from_file_location("readme_numbers", ROOT / "scripts" / "readme_numbers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_the_scripts_output():
    numbers = _readme_numbers()
    expected = numbers.render(numbers.load())
    assert numbers.readme_table((ROOT / "README.md").read_text()) == expected, (
        "README.md's headline table differs from docs/e2e_runs.json: run python scripts/readme_numbers.py --write"
    )


def test_the_table_compares_within_one_run_only():
    numbers = _readme_numbers()
    runs = numbers.load()
    compared = numbers.comparisons(runs)
    assert compared
    for c in compared:
        assert c["peer"] in c["run"]["rows"] and c["fastft"] in c["run"]["rows"]
        assert not c["peer"]["leaks"] and c["fastft"]["column"].startswith("fastft")


def test_a_new_gpu_run_takes_the_tables_place(tmp_path):
    numbers = _readme_numbers()
    runs = tmp_path / "runs.json"
    runs.write_text((ROOT / "docs" / "e2e_runs.json").read_text())
    # quant "none" as ``--json`` writes it (the recorded runs before it left it out: the same key)
    row = dict(model="Llama-3.2-1B", layers=16, stream="padding-free", quant="none", leaks=False, peak_gib=1.0)
    record = dict(date="2099-01-01", device="NVIDIA H100 80GB HBM3 (sm90)", versions={}, command="python -m fastft e2e")
    record["rows"] = [
        dict(row, column="stock sdpa", tokens_per_s=1000.0),
        dict(row, column="fastft", tokens_per_s=3000.0),
    ]
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(dict(record, device="x86_64 CPU (Triton interpreter)")))
    with pytest.raises(SystemExit, match="not the --json record of a GPU run"):
        numbers.add(cpu, runs)
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(record))
    numbers.add(gpu, runs)
    table = numbers.render(numbers.load(runs))
    assert (
        "| Llama-3.2-1B (16 layers) | `stock sdpa` | 1,000 | **3,000** (`fastft`) | **3.00x** | 1.00 / 1.00 |" in table
    )
    assert "2026-11-25 to 2099-01-01" in table.replace("\n", " ")


def _public_names():
    """(module path, name) for every name in an ``__all__`` of fastft's public modules (not the benchmarks,
    the main job or the references): read from the source, so no optional package is imported."""
    names = []
    for path in sorted((ROOT / "fastft").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("fastft/bench/", "fastft/e2e/", "fastft/reference/")):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                names += [(rel, name) for name in ast.literal_eval(node.value)]
    return names


def test_the_reference_names_every_public_name():
    text = re.sub(r"^```.*?^```", "", (ROOT / "docs" / "reference.md").read_text(), flags=re.S | re.M)
    quoted = set(re.findall(r"`([^`]+)`", text))  # inline code, outside the examples
    words = {w for q in quoted for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", q)}
    missing = [f"{rel}: {name}" for rel, name in _public_names() if name not in words]
    assert len(_public_names()) > 50
    assert not missing, "docs/reference.md does not name: " + ", ".join(missing)


def test_no_session_names_in_the_docs():
    pattern = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth) session\b|\bsession \d")
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{page.relative_to(ROOT)}:{n}: {line}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run's command is the README's first command (install, then the tests)."""
    readme = (ROOT / "README.md").read_text()
    command = next(line.split("#")[0].strip() for line in readme.splitlines() if "scripts/setup.sh &&" in line)
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
