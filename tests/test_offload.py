"""fastft.offload without a GPU: plain checkpointing fallback (same grads), configuration and errors."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fastft
from fastft import offload


def _layer(x, w, scale=1.0, *, bias=None):
    h = F.dropout(torch.tanh(x @ w), p=0.3, training=True) * scale
    return h + bias if bias is not None else h


def _run(ckpt, x0, weights, bias):
    torch.manual_seed(1234)
    x = x0
    for w in weights:
        x = ckpt(_layer, x, w, 0.5, bias=bias)
    return x.square().sum()


def test_cpu_falls_back_to_checkpoint_with_identical_grads(rng):
    g = rng
    weights = [torch.randn(16, 16, generator=g, requires_grad=True) for _ in range(8)]
    bias = torch.randn(16, generator=g, requires_grad=True)
    x0 = torch.randn(8, 16, generator=g, requires_grad=True)
    params = [x0, bias, *weights]
    expected_loss = _run(lambda f, *a, **k: checkpoint(f, *a, use_reentrant=False, **k), x0, weights, bias)
    expected = torch.autograd.grad(expected_loss, params)
    loss = _run(fastft.offloaded_checkpoint, x0, weights, bias)
    grads = torch.autograd.grad(loss, params)
    assert torch.equal(loss, expected_loss)
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)
    assert offload.offloader_for(x0) is None


def test_no_grad_runs_the_function_directly():
    calls = []

    def f(x):
        calls.append(torch.is_grad_enabled())
        return x * 2

    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        y = fastft.offloaded_checkpoint(f, x)
    with torch.inference_mode():
        fastft.offloaded_checkpoint(f, torch.ones(3))
    assert calls == [False, False] and not y.requires_grad


def test_config_resolution(monkeypatch):
    for name in ("FASTFT_OFFLOAD", "FASTFT_OFFLOAD_DOUBLE_BUFFER", "FASTFT_OFFLOAD_MIN_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert offload.OffloadConfig().resolve() == ("auto", "auto", 1 << 20)
    monkeypatch.setenv("FASTFT_OFFLOAD", "0")
    monkeypatch.setenv("FASTFT_OFFLOAD_DOUBLE_BUFFER", "off")
    monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "4096")
    assert offload.OffloadConfig().resolve() == (False, False, 4096)
    assert offload.OffloadConfig(enabled=True, double_buffer="auto", min_bytes=0).resolve() == (True, "auto", 0)
    monkeypatch.setenv("FASTFT_OFFLOAD", "maybe")
    with pytest.raises(ValueError, match="FASTFT_OFFLOAD must be one of"):
        offload.OffloadConfig().resolve()
    monkeypatch.setenv("FASTFT_OFFLOAD", "1")
    monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "1MB")
    with pytest.raises(ValueError, match="FASTFT_OFFLOAD_MIN_BYTES must be an int"):
        offload.OffloadConfig().resolve()


def test_bad_input():
    with pytest.raises(ValueError, match="enabled must be 'auto', True or False"):
        offload.OffloadConfig(enabled="yes")
    with pytest.raises(ValueError, match="double_buffer must be"):
        offload.OffloadConfig(double_buffer=2)
    with pytest.raises(ValueError, match="min_bytes must be an int >= 0"):
        offload.OffloadConfig(min_bytes=-1)
    with pytest.raises(ValueError, match="use_reentrant must be False"):
        fastft.offloaded_checkpoint(torch.sin, torch.ones(2, requires_grad=True), use_reentrant=True)
    with pytest.raises(ValueError, match="enabled must be 'auto', True or False"):
        offload.OffloadConfig(enabled=1)  # 1 == True, but not a documented choice
    with pytest.raises(TypeError, match="min_bytes must be an int, got bool"):
        offload.OffloadConfig(min_bytes=True)
    with pytest.raises(TypeError, match="offload_config must be a fastft.OffloadConfig or None, got str"):
        fastft.offloaded_checkpoint(torch.sin, torch.ones(2, requires_grad=True), offload_config="auto")
    with pytest.raises(TypeError, match="offload_config must be a fastft.OffloadConfig"):
        offload.offloader_for(torch.ones(2), "auto")


def test_checkpoint_options_pass_through():
    x = torch.randn(4, requires_grad=True)
    y = fastft.offloaded_checkpoint(torch.sin, x, use_reentrant=False, determinism_check="none", debug=False)
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))
