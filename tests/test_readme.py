"""Every Python example in the README runs as written, each in a fresh interpreter, on this machine's device
(a CPU in CI: the examples are device-neutral)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=lambda i: f"block{i}")
def test_readme_example_runs(index, tmp_path):
    code = BLOCKS[index]
    if "import transformers" in code:
        pytest.importorskip("transformers")
        pytest.importorskip("peft")
    if "Trainer" in code:
        pytest.importorskip("accelerate")
    # As a user runs it: from another folder, without the test suite's TRITON_INTERPRET.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 0, f"README block {index} failed:\n{code}\n{out.stdout}\n{out.stderr}"
