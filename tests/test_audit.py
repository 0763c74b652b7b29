"""fastft.audit: launches (top-level aten calls on a CPU, kernel launches on a GPU), host syncs and where they
come from, per-layer rows; python -m fastft audit."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import fastft
from fastft.audit import audit

GPU = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(GPU, reason="counts aten calls, what a CPU run reports")
def test_counts_each_top_level_aten_call():
    x = torch.randn(8, 8)
    report = audit(lambda: (torch.relu(x @ x) + 1).sum(), steps=3, warmup=0)  # mm, relu, add, sum
    assert report.launches == 4 and report.syncs == 0 and report.kernel_ms is None
    assert report.top_sources == [("outside any module", 4)]
    assert "4 (top-level aten calls)" in str(report)


def test_layers_and_sources_of_a_packed_training_step():
    transformers = pytest.importorskip("transformers")
    from fastft.integrations.transformers import apply
    from fastft.testing import tiny_hf_model

    device = "cuda" if GPU else "cpu"
    model = apply(tiny_hf_model("llama", torch.bfloat16 if GPU else torch.float32, device))
    ids = torch.randint(0, 128, (1, 40), device=device)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)  # host lengths: no sync
    batch = collate([{"input_ids": ids[0, :15].tolist()}, {"input_ids": ids[0, 15:].tolist()}])
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    report = audit(lambda: model(**batch).loss.backward(), model=model, layers=model.model.layers, steps=2)
    assert [row["layer"] for row in report.layers] == [0, 1]
    first, second = report.layers
    assert first["launches"] == second["launches"] > 0  # identical layers, forward and recompute
    assert first["launches"] + second["launches"] < report.launches
    sources = dict(report.top_sources)
    assert "LlamaAttention" in sources and any(s.startswith("backward: ") for s in sources)
    assert report.syncs == 0, report.sync_sources
    if GPU:
        assert report.kernel_ms > 0 and 0 < report.busy <= 1 and first["kernel_ms"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_finds_a_host_sync_and_its_op():
    x = torch.randn(256, 256, device="cuda")
    report = audit(lambda: (x @ x).sum().item(), steps=2)
    assert report.syncs >= 1 and report.launches >= 2
    assert any("item" in op or "_local_scalar_dense" in op for op, _ in report.sync_sources), report.sync_sources


def _event(name, start, end, thread=1, parent=None):
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread, cpu_parent=parent
    )


def test_idle_gaps_are_charged_to_the_innermost_host_range():
    from fastft.audit import _MODULE, _idle_sources

    # thread 1: a module range holding aten::mm (its launch inside) and then Python; thread 2: a backward node
    module = _event(_MODULE + "Attention", 0, 100)
    mm = _event("aten::mm", 10, 30, parent=module)
    launch = _event("cudaLaunchKernel", 20, 28, parent=mm)
    node = _event("autograd::engine::evaluate_function: MmBackward0", 120, 180, thread=2)
    node_mm = _event("aten::mm", 130, 170, thread=2, parent=node)
    spans = [(5, 15), (40, 60), (100, 125), (175, 190)]  # device work (us); two overlapping would merge
    windows = [(0, 200)]
    idle = _idle_sources([module, mm, launch, node, node_mm], spans, windows)
    # gaps: 0-5 (module, Python), 15-40 (mid 27.5: in the launch under aten::mm), 60-100 (module, Python),
    # 125-175 (mid 150: aten::mm under the node), 190-200 (nothing open)
    assert dict(idle) == pytest.approx(
        {
            "Attention: Python between ops": (5 + 40) / 1000,
            "Attention: aten::mm": 25 / 1000,
            "backward: MmBackward0: aten::mm": 50 / 1000,
            "no profiled range (Python outside the step's ops)": 10 / 1000,
        }
    )
    assert sum(idle.values()) == pytest.approx((200 - 10 - 20 - 25 - 15) / 1000)  # the window minus device time
    # a copy on another stream covering the middle of 60-100 takes that gap; one ending before 125-175's does not
    side = [(70, 90, "Memcpy HtoD (Pinned -> Device)"), (126, 140, "Memcpy DtoH (Device -> Pinned)")]
    idle = _idle_sources([module, mm, launch, node, node_mm], spans, windows, side)
    assert idle["another stream: Memcpy HtoD (Pinned -> Device)"] == pytest.approx(40 / 1000)
    assert idle["Attention: Python between ops"] == pytest.approx(5 / 1000)
    assert idle["backward: MmBackward0: aten::mm"] == pytest.approx(50 / 1000)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_gpu_idle_while_the_host_sleeps_is_charged_to_its_module():
    class Sleepy(torch.nn.Module):
        def forward(self, x):
            y = x @ x
            time.sleep(0.02)  # the GPU runs dry while the host is here
            return y @ x

    model = Sleepy()
    x = torch.randn(512, 512, device="cuda")
    report = audit(lambda: model(x).sum(), model=model, steps=2)
    where, ms = report.idle_sources[0]
    assert where == "Sleepy: Python between ops" and 15 < ms < 40, report.idle_sources
    assert sum(ms for _, ms in report.idle_sources) <= report.idle_ms + 1e-6
    assert ms <= report.idle_ms <= report.wall_ms
    assert "compute stream idle" in str(report) and "Sleepy: Python between ops" in str(report)


def test_bad_arguments():
    with pytest.raises(TypeError, match="step must be a callable"):
        audit(None)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        audit(lambda: None, steps=0)
    with pytest.raises(TypeError, match="warmup must be an int"):
        audit(lambda: None, warmup=1.0)
    with pytest.raises(TypeError, match="steps must be an int"):
        audit(lambda: None, steps=True)
    assert audit(lambda: None, steps=np.int64(2), warmup=np.int64(0)).steps == 2  # numpy ints, as elsewhere
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        audit(lambda: None, model="llama")
    with pytest.raises(TypeError, match="layers must be an iterable of torch.nn.Module"):
        audit(lambda: None, layers=torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"layers\[1\] must be a torch.nn.Module, got str"):
        audit(lambda: None, layers=[torch.nn.Linear(2, 2), "layer"])
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="layers must not hold the same module twice"):
        audit(lambda: None, layers=[layer, layer])
    assert fastft.audit is audit


def test_layers_without_a_model_get_their_rows():
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
    x = torch.randn(3, 4)
    report = audit(lambda: layers[1](layers[0](x)).sum(), layers=layers, steps=2, warmup=0)
    assert [row["layer"] for row in report.layers] == [0, 1]
    if not GPU:
        assert [row["launches"] for row in report.layers] == [1, 1]  # one aten::linear each
        assert dict(report.top_sources) == {"Linear": 2, "outside any module": 1}


def test_importing_audit_does_not_import_transformers():
    code = "import sys, fastft.audit; assert 'transformers' not in sys.modules, 'transformers was imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_the_profilers_own_log_lines_are_left_out(capfd):
    from fastft.audit import _without_profiler_log

    kineto = b"USDT:2026-01-01 00:00:00 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
    with _without_profiler_log():
        os.write(2, kineto + b"a real warning\n" + kineto.replace(b"USDT", b"STAGE"))
    assert capfd.readouterr().err == "a real warning\n"


def test_cli_audits_the_e2e_step():
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FASTFT_BACKEND": "torch"}
    cmd = [sys.executable, "-m", "fastft", "audit", "--model", "Llama-3.2-1B", "--steps", "1", "--quick"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "top launch sources:" in out.stdout and "layer   1:" in out.stdout
    assert "Llama-3.2-1B, column 'fastft', padding-free stream (tiny config)" in out.stdout  # a fresh batch a step
    assert "profiler_start" not in out.stderr and "profiler_stop" not in out.stderr  # no stray profiler log
    out = subprocess.run(cmd + ["--column", "fastft, experts lora"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 2 and "needs a MoE model" in out.stderr and "Traceback" not in out.stderr
