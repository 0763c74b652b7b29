"""python -m fastft info | check | bench, as a user runs them (on this machine's device)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fastft", *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_info():
    out = run("info")
    assert out.returncode == 0, out.stderr
    assert "device:" in out.stdout and "packing.sdpa_mask" in out.stdout and "backend=" in out.stdout


def test_check_runs_cases():
    out = run("check", "--seconds", "1", "--max-tokens", "48")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 failures" in out.stdout


def test_bench_quick_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = run("bench", "--quick", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(path.read_text())
    assert record["device"] and record["rows"] and all(r["fastft_ms"] > 0 for r in record["rows"])
    assert "sdpa_mask" in out.stdout and "speedup" in out.stdout


def test_bench_e2e_runs_tiny_models(tmp_path):
    import pytest

    pytest.importorskip("transformers")
    path = tmp_path / "e2e.json"
    out = run("bench", "--e2e", "--quick", "--model", "Qwen3-0.6B", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    columns = {"naive glue", "stock sdpa", "fastft, peft lora", "fastft"} | ({"stock flex"} if torch.cuda.is_available() else set())
    assert {r["column"] for r in rows} == columns
    assert all(r["step_ms"] > 0 and r["model"] == "Qwen3-0.6B" for r in rows)
