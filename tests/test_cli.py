"""python -m fastft info | check | bench, as a user runs them (on this machine's device)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def run(*args, **env_vars):
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # what this process imports
    env = {**os.environ, "PYTHONPATH": path, **env_vars}
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
    pytest.importorskip("transformers")
    path = tmp_path / "e2e.json"
    out = run("bench", "--e2e", "--quick", "--model", "Qwen3-0.6B", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    columns = {"naive glue", "stock sdpa", "stock sdpa, padded", "fastft, peft lora", "fastft"}
    if torch.cuda.is_available():
        columns.update({"stock sdpa, hf offload", "stock flex", "fastft, graphs"})
        if importlib.util.find_spec("liger_kernel") is not None:
            columns.update({"liger + stock flex", "fastft + liger", "fastft + liger, graphs"})
            columns.add("fastft + liger, graphs auto")
        if importlib.util.find_spec("unsloth") is not None:
            columns.add("unsloth")
    if importlib.util.find_spec("peft") is None:
        columns.discard("fastft, peft lora")  # the same configuration as "fastft" without peft
        assert "peft is not installed" in out.stdout
    assert {r["column"] for r in rows} == columns
    assert all(r["step_ms"] > 0 and r["model"] == "Qwen3-0.6B" and r["stream"] == "padding-free" for r in rows)
    for r in rows:  # the default stream: 1 first step, then 2 timed ones, each on a fresh batch
        assert r["warmup"] == 1 and r["steps"] == 2 and len(r["losses"]) == 3 and len(r["first_step_s"]) == 1
        assert r["tokens_per_s"] > 0 and r["first_steps_s"] > 0 and 0 < r["tokens_min"] <= r["tokens_max"] <= 256
        captured = r["captures_first"] + r["captures_timed"]
        if r["column"].endswith(", graphs"):
            assert captured > 0, r
        elif not r["column"].endswith(", graphs auto"):  # auto captures where it times the layers launch-bound
            assert captured == 0, r
    assert "first 1 steps" in out.stdout and "| padding-free | " in out.stdout and "vs fastest peer  " in out.stdout
    assert "loss check Qwen3-0.6B, padding-free: largest relative difference to naive glue over 3 steps" in out.stdout
    assert "FAILS" not in out.stdout
    if not torch.cuda.is_available():
        assert "not how fast it is" in out.stdout and "peak n/a" in out.stdout and "0.00 GiB" not in out.stdout
        assert "\n    'stock sdpa, hf offload': needs a GPU\n" in out.stdout  # one skipped column a line


def test_bench_e2e_columns_of_a_moe_model(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    path = tmp_path / "e2e.json"
    columns = ["stock sdpa", "fastft", "fastft, experts lora"]
    out = run(
        "bench",
        "--e2e",
        "--quick",
        "--model",
        "Qwen3-30B-A3B",
        *[f"--column={c}" for c in columns],
        "--stream=fixed",
        "--steps=1",
        "--json",
        str(path),
        FASTFT_BACKEND="torch",  # the interpreter's routing is slow, and not what this checks
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    assert [r["column"] for r in rows] == columns
    assert all(r["stream"] == "fixed" and r["tokens_min"] == r["tokens_max"] == 256 for r in rows)
    assert all(len(r["losses"]) == 2 for r in rows)
    assert "| fastft, experts lora |" in out.stdout and "x (stock sdpa) |" in out.stdout
    assert "loss check Qwen3-30B-A3B, fixed: largest relative difference to stock sdpa" in out.stdout
    assert "FAILS" not in out.stdout


@pytest.mark.distributed
def test_bench_e2e_nproc(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "dist.json"
    args = ["--model", "Qwen3-30B-A3B", "--column", "fastft", "--parallel", "ep", "--parallel", "fsdp2"]
    nproc = str(min(2, torch.cuda.device_count())) if torch.cuda.is_available() else "2"
    out = run("bench", "--e2e", "--quick", "--nproc", nproc, *args, "--json", str(path), FASTFT_BACKEND="torch")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    worlds = sorted({1, int(nproc)})
    assert [(r["parallel"], r["world"]) for r in rows] == [(m, w) for m in ("ep", "fsdp2") for w in worlds]
    assert all(r["step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0 for r in rows)
    assert all(r["scaling"] == 1.0 for r in rows if r["world"] == 1)
    assert "| Qwen3-30B-A3B | 2 | ep | fastft |" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("bench", "--e2e", "--parallel", "ep"), "--parallel is taken with --nproc only"),
        (("bench", "--nproc", "2"), "--nproc is taken with --e2e only"),
        (("bench", "--e2e", "--nproc", "0"), "--nproc: must be > 0, got 0"),
        (("bench", "--e2e", "--nproc", "2", "--parallel", "tp"), "invalid choice: 'tp'"),
        (("bench", "--e2e", "--model", "llama"), "invalid choice: 'llama' (choose from 'Llama-3.2-1B'"),
        (("bench", "--model", "Qwen3-0.6B"), "--model is taken with --e2e only"),
        (("bench", "--column", "fastft"), "--column is taken with --e2e only"),
        (("bench", "--e2e", "--column", "liger"), "invalid choice: 'liger' (choose from 'naive glue'"),
        (("bench", "--e2e", "--stream", "packed"), "invalid choice: 'packed' (choose from 'fixed', 'padding-free'"),
        (("bench", "--steps", "50"), "--steps is taken with --e2e only"),
        (("bench", "--e2e", "--nproc", "2", "--stream", "fixed"), "--stream is taken with --e2e only (not with"),
        (("bench", "--e2e", "--warmup", "0"), "--warmup: must be > 0, got 0"),
        (("audit", "--stream", "both"), "invalid choice: 'both' (choose from 'fixed', 'padding-free')"),
        (("check", "--max-tokens", "0"), "--max-tokens: must be > 0, got 0"),
        (("check", "--max-tokens", "-3"), "--max-tokens: must be > 0, got -3"),
        (("check", "--seconds", "x"), "--seconds: expected a float, got 'x'"),
        (("info", "--device", "nonsense"), "--device: not a torch device: 'nonsense'"),
        (("bench", "--e2e", "--json", "no-such-folder/e2e.json"), "the folder"),
        (("bench", "--quick", "--json", "no-such-folder/bench.json"), "no-such-folder does not exist"),
        (("bench", "--json", "tests"), "--json tests: not a file this user can write"),
        (
            ("bench", "--e2e", "--quick", "--model", "Qwen3-30B-A3B", "--nproc", "5", "--parallel", "ep"),
            "8 experts do not split over --nproc 5",
        ),
        (
            ("bench", "--e2e", "--model", "Qwen3-0.6B", "--column", "fastft, experts lora"),
            "--column 'fastft, experts lora' needs a MoE model, not Qwen3-0.6B",
        ),
    ],
)
def test_user_mistakes_are_usage_errors(args, message, capsys):
    from fastft.__main__ import main

    with pytest.raises(SystemExit) as exit:  # in this process: a subprocess each would cost seconds of imports
        main(list(args))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err, err
    assert err.startswith("usage: python -m fastft ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a missing GPU")
def test_cuda_device_without_gpu_is_a_usage_error():
    out = run("info", "--device", "cuda")
    assert out.returncode == 2 and "this torch sees no CUDA device" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a missing GPU")
def test_gpu_only_column_on_a_cpu_says_why():
    out = run("bench", "--e2e", "--column", "stock flex")
    assert out.returncode == 2 and "--column 'stock flex' cannot run here: it needs a GPU" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "ms/step" not in out.stdout  # refused before any column ran


def test_help_lists_every_command_and_defines_the_ratios():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for command in ("info", "check", "bench", "audit", "tune"):
        assert f"    {command} " in out.stdout, f"{command} missing from --help"
    assert "``" not in out.stdout  # reST markup read raw
    out = run("bench", "--help")
    assert "vs fastest peer  fastft columns:" in out.stdout and "ms / fastft's  " in out.stdout


def test_every_option_has_help():
    import argparse

    from fastft.__main__ import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"
    assert "Llama-3.2-1B" in run("bench", "--help").stdout
