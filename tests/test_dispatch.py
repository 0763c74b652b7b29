import pytest
import torch

from fastft import dispatch

OP = "packing.sdpa_mask"


def test_override_values_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.backend_for(OP, "cpu", "cuda")
    monkeypatch.setenv("FASTFT_BACKEND", "fast")
    with pytest.raises(ValueError, match="FASTFT_BACKEND must be one of"):
        dispatch.backend_for(OP, "cpu")


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.backend_for("packing.nope", "cpu")


def test_cpu_uses_torch_unless_interpreting(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.backend_for(OP, "cpu") == "torch"
    with pytest.raises(ValueError, match="backend='triton' cannot run"):
        dispatch.backend_for(OP, "cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.backend_for(OP, "cpu") == "triton"
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    assert dispatch.backend_for(OP, "cpu") == "torch"
    assert dispatch.backend_for(OP, "cpu", "triton") == "triton"  # the per-call argument wins


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("sm80", "triton"),
        ("sm86", "triton"),
        ("sm89", "triton"),
        ("sm90", "triton"),
        ("sm100", "triton"),
        ("sm103", "triton"),
        ("sm120", "triton"),
        ("rocm:gfx942", "triton"),
        ("sm75", "torch"),
    ],
)
def test_gpu_architectures(monkeypatch, arch, expected):
    monkeypatch.setattr(dispatch, "arch", lambda device=None: arch)
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(dispatch, "_warned", set())
    if expected == "torch":
        with pytest.warns(RuntimeWarning, match=arch):
            assert dispatch.backend_for(OP, torch.device("cuda", 0)) == "torch"
    else:
        assert dispatch.backend_for(OP, torch.device("cuda", 0)) == expected


def test_unknown_arch_warns_once(monkeypatch, recwarn):
    monkeypatch.setattr(dispatch, "arch", lambda device=None: "sm70")
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(dispatch, "_warned", set())
    for _ in range(3):
        assert dispatch.backend_for(OP, torch.device("cuda", 0)) == "torch"
    assert sum("sm70" in str(w.message) for w in recwarn) == 1


def test_no_triton_falls_back(monkeypatch):
    monkeypatch.setattr(dispatch, "TRITON_AVAILABLE", False)
    assert dispatch.backend_for(OP, torch.device("cuda", 0)) == "torch"
    with pytest.raises(ValueError, match="importable triton"):
        dispatch.backend_for(OP, torch.device("cuda", 0), "triton")
