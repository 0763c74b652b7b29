"""The built wheel is what users get: build it, install it into a fresh environment outside the source tree,
and use it there (every module imports, the CLI runs, the Hugging Face integration is present)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set[str]:
    """Every package of the source tree under its installed name (kernels/ installs as fastft.kernels)."""
    found = set()
    for top, installed in (
        ("fastft", "fastft"),
        ("kernels", "fastft/kernels"),
        ("autotune_cache", "fastft/autotune_cache"),
    ):
        for d in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir() and p.name != "__pycache__")]:
            if (d / "__init__.py").exists() or any(d.glob("*.json")):
                found.add(installed + d.as_posix()[len((ROOT / top).as_posix()) :])
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fastft", "kernels", "autotune_cache"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        check=True,
    )
    (path,) = (tmp / "dist").glob("fastft-*.whl")
    return path


def test_wheel_holds_every_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    folders = {n.rsplit("/", 1)[0] for n in names if "/" in n and ".dist-info" not in n}
    missing = _source_packages() - folders
    assert not missing, f"packages missing from the wheel (pyproject.toml's package list): {sorted(missing)}"
    assert "fastft/integrations/transformers/__init__.py" in names and "fastft/kernels/packing.py" in names
    assert any(n.startswith("fastft/autotune_cache/") and n.endswith(".json") for n in names)
    # kernels/ ships as fastft.kernels, never as a top-level `kernels` (Hugging Face's package name).
    assert not [n for n in names if n.split("/")[0] in ("kernels", "autotune_cache", "tests")]


def test_installed_wheel_works_outside_the_source_tree(wheel, tmp_path):
    # A fresh virtual environment that sees this interpreter's packages (torch, transformers, peft: nothing
    # is downloaded) and gets the wheel itself installed into it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", str(wheel)], check=True
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args):
        out = subprocess.run([python, *args], capture_output=True, text=True, env=env, cwd=work)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    imported = run(
        "-c",
        (
            "import importlib, pkgutil, fastft\n"
            "names = [m.name for m in pkgutil.walk_packages(fastft.__path__, 'fastft.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "from fastft.integrations.transformers import apply\n"
            "print(fastft.__file__); print(len(names))\n"
        ),
    ).split()
    assert imported[0].startswith(str(venv)), f"fastft came from {imported[0]}, not the installed wheel"
    assert int(imported[1]) >= 20
    assert "packing.sdpa_mask" in run("-m", "fastft", "info")
    pytest.importorskip("transformers")
    out = run("-m", "fastft", "e2e", "--quick", "--model", "Qwen3-0.6B")
    assert "Qwen3-0.6B" in out and out.splitlines()[-1].startswith("loss check: PASS")
