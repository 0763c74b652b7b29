"""scripts/compile_kernels.py: launches recorded in Triton's interpreter, compiled for CUDA GPUs without one."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "compile_kernels.py")

KERNELS = """
import triton
import triton.language as tl


@triton.jit
def square(x_ptr, n, B: tl.constexpr, TRANSPOSE: tl.constexpr):
    r = tl.arange(0, B)
    a = tl.load(x_ptr + r[:, None] * B + r[None, :], mask=(r < n)[:, None], other=0.0)
    if TRANSPOSE:
        a = tl.trans(a)
    tl.store(x_ptr + r[:, None] * B + r[None, :], tl.dot(a, a), mask=(r < n)[:, None])
"""

LAUNCHES = """
import torch

import fastft_compile_probe as k


def test_launches():
    x = torch.randn(256)
    k.square[(1,)](x, 3, B=4, TRANSPOSE=False)  # a dot 4 wide: the interpreter computes it, no GPU compiles it
    k.square[(1,)](x, 3, B=16, TRANSPOSE=False)
    k.square[(1,)](x, 16, B=16, TRANSPOSE=True)
"""


def run(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, SCRIPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


def test_records_each_launch_and_names_the_one_no_gpu_compiles(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    (tmp_path / "fastft_compile_probe.py").write_text(textwrap.dedent(KERNELS))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(LAUNCHES))
    launches = tmp_path / "launches.json"
    recorded = run(tmp_path, "record", str(launches), "--", "-q", "-p", "no:cacheprovider", "test_probe.py")
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    got = json.loads(launches.read_text())
    assert [(x["kernel"], x["args"]["B"], x["args"]["n"], x["args"]["TRANSPOSE"]) for x in got] == [
        ("square", 4, 17, False),  # runtime ints by class: 3 and 16 stand as 17 and 16 (not 1; divisible by 16)
        ("square", 16, 17, False),
        ("square", 16, 16, True),
    ]
    assert got[0]["args"]["x_ptr"] == {"tensor": "float32", "aligned": True}
    compiled = run(tmp_path, "compile", str(launches), "--arch", "90", "--jobs", "2")
    out = compiled.stdout + compiled.stderr
    assert compiled.returncode == 1, out
    # per mode (TRANSPOSE) the smallest launch: B=4 without the transpose, B=16 with it
    assert "compiled 1 of 2 kernel builds for sm_90: 1 kernels, 2 of the 3 distinct launches recorded" in out
    failures = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failures) == 1 and "fastft_compile_probe.square on sm_90" in failures[0] and '"B": 4' in failures[0]
    assert "K >= " in out  # the compiler's own message
