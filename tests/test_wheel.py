"""The wheel installs kernels/ as fastft.kernels, never as a top-level `kernels` (Hugging Face's package name)."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_layout(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("fastft", "kernels", "autotune_cache"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(src)],
        check=True,
    )
    (wheel,) = (tmp_path / "dist").glob("fastft-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fastft/kernels/__init__.py" in names and "fastft/kernels/packing.py" in names
    assert "fastft/reference/packing.py" in names and "fastft/__main__.py" in names
    assert any(n.startswith("fastft/autotune_cache/") and n.endswith(".json") for n in names)
    assert not [n for n in names if n.split("/")[0] in ("kernels", "autotune_cache", "tests")]
