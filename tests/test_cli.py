"""python -m fastft info | check | bench | e2e | audit | tune, as a user runs them (on this machine's device)."""

import argparse
import json
import os
import re
import shlex
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


def test_info_tells_what_a_users_program_runs():
    user = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FASTFT_BACKEND")}
    out = subprocess.run(
        [sys.executable, "-m", "fastft", "info"],
        capture_output=True,
        text=True,
        env={**user, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "device:" in out.stdout and "packing.sdpa_mask" in out.stdout and "backend=" in out.stdout
    if not torch.cuda.is_available():  # no TRITON_INTERPRET: a program on a CPU runs fastft's torch paths
        assert "backend=triton" not in out.stdout and "CPU, fastft's torch paths" in out.stdout
        assert "autotune cache: none on a CPU" in out.stdout and "cpu.json" not in out.stdout


def test_the_banner_says_what_fastft_runs_on_a_cpu(monkeypatch):
    from fastft import cli

    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what check and bench run on a CPU
    monkeypatch.delenv("FASTFT_BACKEND", raising=False)
    assert cli.describe(cpu).endswith("CPU, fastft's Triton kernels in Triton's interpreter")
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    assert cli.describe(cpu).endswith("CPU, fastft's torch paths")
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delenv("FASTFT_BACKEND")
    assert cli.describe(cpu).endswith("CPU, fastft's torch paths")


def test_check_runs_cases_and_says_each_ops_count():
    from fastft.selfcheck import CHECKS

    out = run("check", "--seconds", "1", "--max-tokens", "48")
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 failures" in out.stdout
    for name in CHECKS:
        assert re.search(rf"^  {name} +\d+ cases, 0 failures$", out.stdout, re.M), name


def test_bench_quick_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    out = run("bench", "--quick", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(path.read_text())
    assert record["device"] and record["rows"] and all(r["fastft_ms"] > 0 for r in record["rows"])
    assert "sdpa_mask" in out.stdout and "speedup" in out.stdout


def test_json_record_keeps_the_command_line_as_typed(tmp_path, monkeypatch):
    from fastft import cli

    argv = ["e2e", "--model", "Qwen3.5", "--column", "stock sdpa, padded", "--json", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", ["fastft", *argv])
    cli.write_json(str(tmp_path / "r.json"), torch.device("cpu"), [])
    command = json.loads((tmp_path / "r.json").read_text())["command"]
    assert shlex.split(command) == ["fastft", *argv]


def test_e2e_runs_one_model_and_ends_with_the_verdict(tmp_path):
    pytest.importorskip("transformers")
    from fastft.e2e import stacks

    path = tmp_path / "e2e.json"
    out = run("e2e", "--quick", "--model", "Qwen3-0.6B", "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = [c for c in stacks.COLUMNS if stacks.why_not(c, device) is None]
    assert [r["column"] for r in rows] == [c for c in here if stacks.why_not_on(c, "Qwen3-0.6B") is None]
    assert {"naive glue", "stock sdpa", "fastft"} <= {r["column"] for r in rows}
    assert all(r["step_ms"] > 0 and r["model"] == "Qwen3-0.6B" and r["stream"] == "padding-free" for r in rows)
    for r in rows:  # the default stream: 1 first step, then 2 timed ones, each on a fresh batch
        assert r["warmup"] == 1 and r["steps"] == 2 and len(r["losses"]) == 3 and len(r["first_step_s"]) == 1
        assert r["tokens_per_s"] > 0 and r["first_steps_s"] > 0 and 0 < r["tokens_min"] <= r["tokens_max"] <= 256
        captured = r["captures_first"] + r["captures_timed"]
        if r["column"].endswith(", graphs"):
            assert captured > 0, r
        elif not r["column"].endswith(", graphs auto"):  # auto captures where it times the layers launch-bound
            assert captured == 0, r
    if not stacks.installed("peft"):
        assert "peft is not installed" in out.stdout
    assert "first 1 steps" in out.stdout and "| padding-free | " in out.stdout
    assert "  Qwen3-0.6B, padding-free, against naive glue (3 steps, " in out.stdout and "FAILS" not in out.stdout
    fastft = sum(stacks.COLUMNS[r["column"]].fastft for r in rows)
    last = out.stdout.splitlines()[-1]
    noun = "column equals" if fastft == 1 else "columns equal"
    assert last.startswith(f"loss check: PASS — {fastft} fastft {noun} the reference within "), last
    assert "vs fastest peer" not in out.stdout and "x (" not in out.stdout  # tiny configs: no speed ratios
    if not torch.cuda.is_available():
        assert "no speed ratios on a CPU" in out.stdout and "peak" not in out.stdout
        assert "\n    'stock sdpa, hf offload': needs a GPU\n" in out.stdout  # one skipped column a line
        assert "fastft's torch paths" in out.stdout  # a CPU's default backend
    else:
        assert "no speed ratios with --quick's tiny configs" in out.stdout
    png = tmp_path / "e2e.png"
    assert png.exists() or f"no chart {png}: matplotlib is not installed (pip install matplotlib)" in out.stdout


def test_e2e_columns_of_a_moe_model(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    path = tmp_path / "e2e.json"
    columns = ["stock sdpa", "fastft", "fastft, experts lora"]
    args = ["--model", "Qwen3-30B-A3B", *[f"--column={c}" for c in columns], "--stream=fixed", "--steps=1"]
    out = run("e2e", "--quick", *args, "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    assert [r["column"] for r in rows] == columns
    assert all(r["stream"] == "fixed" and r["tokens_min"] == r["tokens_max"] == 256 for r in rows)
    assert all(len(r["losses"]) == 2 for r in rows)
    assert "| fastft, experts lora |" in out.stdout
    assert "  Qwen3-30B-A3B, fixed, against stock sdpa (2 steps, " in out.stdout
    assert out.stdout.splitlines()[-1].startswith("loss check: PASS — 2 fastft columns")


@pytest.mark.distributed
def test_e2e_nproc(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "dist.json"
    args = ["--model", "Qwen3-30B-A3B", "--column", "fastft", "--parallel", "ep", "--parallel", "shard"]
    nproc = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    out = run("e2e", "--quick", "--nproc", str(nproc), *args, "--json", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(path.read_text())["rows"]
    splits = ("rows", "balanced")
    expected = [("ep", w, s) for w in sorted({1, nproc}) for s in splits] + [("shard", nproc, s) for s in splits]
    assert [(r["parallel"], r["world"], r["split"]) for r in rows] == expected
    for r in rows:
        assert r["step_ms"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["scaling"] > 0, r
        assert r["steps"] == 2 and r["warmup"] == 1 and len(r["rank_step_ms"]) == r["world"]
        if r["world"] > 1:  # ranks of their own shares
            assert len(r["work_ms"]) == len(r["wait_ms"]) == nproc and all(w > 0 for w in r["work_ms"])
        else:
            assert r["work_ms"] is r["wait_ms"] is r["imbalance"] is None
    assert f"| Qwen3-30B-A3B | 2 | ep | fastft | balanced | {nproc} |" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("e2e", "--parallel", "ep"), "--parallel is taken with --nproc only"),
        (("bench", "--nproc", "2"), "unrecognized arguments: --nproc 2"),
        (("bench", "--e2e"), "bench --e2e is now its own command: python -m fastft e2e"),
        (("e2e", "--nproc", "0"), "--nproc: must be > 0, got 0"),
        (("e2e", "--layers", "deep"), "--layers: expected a number of layers or 'all', got 'deep'"),
        (("audit", "--layers", "deep"), "--layers: expected a number of layers or 'all', got 'deep'"),
        (("e2e", "--nproc", "2", "--layers", "4"), "--layers is not taken with --nproc"),
        (("e2e", "--nproc", "2", "--parallel", "tp"), "invalid choice: 'tp'"),
        (("e2e", "--model", "llama"), "invalid choice: 'llama' (choose from 'Llama-3.2-1B'"),
        (("bench", "--model", "Qwen3-0.6B"), "unrecognized arguments: --model"),
        (("e2e", "--column", "liger"), "invalid choice: 'liger' (choose from 'naive glue'"),
        (("e2e", "--stream", "packed"), "invalid choice: 'packed' (choose from 'fixed', 'padding-free'"),
        (("e2e", "--nproc", "2", "--stream", "fixed"), "--stream is not taken with --nproc"),
        (("e2e", "--warmup", "0"), "--warmup: must be > 0, got 0"),
        (("e2e", "--backend", "cuda"), "invalid choice: 'cuda' (choose from 'auto', 'torch', 'triton')"),
        (
            ("tune", "--only", "attention"),
            "invalid choice: 'attention' (choose from 'delta_rule'",
        ),
        (("audit", "--stream", "both"), "invalid choice: 'both' (choose from 'fixed', 'padding-free')"),
        (("check", "--max-tokens", "0"), "--max-tokens: must be > 0, got 0"),
        (("check", "--max-tokens", "-3"), "--max-tokens: must be > 0, got -3"),
        (("check", "--seconds", "x"), "--seconds: expected a float, got 'x'"),
        (("info", "--device", "nonsense"), "--device: not a torch device: 'nonsense'"),
        (("e2e", "--json", "no-such-folder/e2e.json"), "the folder"),
        (("bench", "--quick", "--json", "no-such-folder/bench.json"), "no-such-folder does not exist"),
        (("bench", "--json", "tests"), "--json: tests: not a file this user can write"),
        (
            ("e2e", "--quick", "--model", "Qwen3-30B-A3B", "--nproc", "5", "--parallel", "ep"),
            "8 experts do not split over --nproc 5",
        ),
        (
            ("e2e", "--nproc", "2", "--model", "Qwen3-0.6B", "--parallel", "ep"),
            "--parallel ep needs a MoE --model (Qwen3-30B-A3B, gpt-oss-20b, Qwen3.5-MoE, Qwen3-Next, "
            "Granite-4.0-H-Tiny)",
        ),
        (
            ("e2e", "--nproc", "2", "--model", "Qwen3-30B-A3B", "--parallel", "ep", "--column", "stock sdpa"),
            "--parallel ep is fastft's expert parallelism: it needs a fastft --column",
        ),
        (
            ("e2e", "--model", "Qwen3-0.6B", "--column", "fastft, experts lora"),
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
def test_layers_on_a_cpu_is_a_usage_error(capsys):
    from fastft.__main__ import main

    for command in ("e2e", "audit"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--model", "Qwen3-8B", "--layers", "all"])
        assert exit.value.code == 2 and "--layers is taken at real size only" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: a CPU refuses --layers before the count")
def test_layers_beyond_the_models_depth_is_a_usage_error(capsys):
    from fastft.__main__ import main

    for command in ("e2e", "audit"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--model", "Qwen3-8B", "--layers", "37"])
        assert exit.value.code == 2 and "--layers: layers must be an int in [1, 36]" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error for a missing GPU")
def test_gpu_only_column_on_a_cpu_says_why():
    out = run("e2e", "--column", "stock flex")
    assert out.returncode == 2 and "--column 'stock flex' cannot run here: it needs a GPU" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "ms/step" not in out.stdout  # refused before any column ran


def test_help_lists_every_command_and_defines_the_ratios():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for command in ("info", "check", "bench", "e2e", "audit", "tune"):
        assert f"    {command} " in out.stdout, f"{command} missing from --help"
    assert "``" not in out.stdout  # reST markup read raw
    out = run("e2e", "--help")
    assert "vs fastest peer  fastft columns:" in out.stdout and "ms / fastft's  " in out.stdout
    assert "Llama-3.2-1B" in out.stdout and "loss check: PASS" in out.stdout


def test_every_option_has_help():
    from fastft.__main__ import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.option_strings} has no help text"


def test_one_list_of_op_families():
    """bench runs a module per op family, found in fastft/bench/; tune offers the families it measures."""
    from fastft import bench
    from fastft.__main__ import build_parser

    names = sorted(p.stem for p in (ROOT / "fastft" / "bench").glob("*.py") if p.stem not in ("__init__", "common"))
    assert list(bench.FAMILIES) == names and all(hasattr(m, "run") for m in bench.modules().values())
    assert bench.tuned() == tuple(n for n, m in bench.modules().items() if hasattr(m, "tune_launchers"))
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    only = {name: next(a for a in sub.choices[name]._actions if a.dest == "only").choices for name in ("bench", "tune")}
    assert only == {"bench": list(bench.FAMILIES), "tune": list(bench.tuned())}


def test_e2e_nproc_refuses_columns_it_cannot_run():
    pytest.importorskip("transformers")
    out = run("e2e", "--nproc", "1", "--column", "stock sdpa, padded")
    assert out.returncode == 2 and "does not run under --nproc: it trains on padded rows" in out.stderr
