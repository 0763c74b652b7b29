"""One formatter and linter for the whole tree: ``ruff format`` and ``ruff check`` (pyproject.toml's config)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    pytest.importorskip("ruff", reason="ruff comes with the test extras (pip install -e '.[test]')")
    out = subprocess.run([sys.executable, "-m", "ruff", *command, "."], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
