"""Backend choice for every fastft op, in one place.

``backend_for(op, device, backend=None)`` returns ``"triton"`` or ``"torch"``:

1. the per-call ``backend=`` argument, else the ``FASTFT_BACKEND`` environment variable
   (``auto`` | ``triton`` | ``torch``), else ``auto``;
2. ``auto``: a CUDA device whose architecture is in the op's list -> triton; a ROCm device -> triton
   (Triton supports ROCm); CPU -> torch, unless ``TRITON_INTERPRET=1`` (tests), then triton;
   any other GPU architecture -> torch, with one warning per architecture.
"""

from __future__ import annotations

import os
import warnings

import torch

from .capabilities import TRITON_AVAILABLE, arch, interpreting

__all__ = ["backend_for", "requested_backend"]

BACKENDS = ("auto", "triton", "torch")

# CUDA architectures fastft's Triton kernels are built and tested for (Ampere, Ada, Hopper, Blackwell).
TRITON_ARCHS = ("sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120")

# op name -> architectures where its Triton path is the default. Every op registers here.
OPS: dict[str, frozenset[str]] = {}


def register(op: str, archs=TRITON_ARCHS) -> str:
    OPS[op] = frozenset(archs)
    return op


_warned: set[str] = set()


def _warn_unknown_arch(name: str) -> None:
    if name in _warned:
        return
    _warned.add(name)
    warnings.warn(
        f"fastft: no Triton kernels are validated for GPU architecture {name}; using the torch "
        "reference implementations (set FASTFT_BACKEND=triton to force Triton).",
        RuntimeWarning,
        stacklevel=3,
    )


def requested_backend(backend: str | None = None) -> str:
    choice = backend if backend is not None else os.environ.get("FASTFT_BACKEND", "auto")
    if choice not in BACKENDS:
        source = "backend" if backend is not None else "FASTFT_BACKEND"
        raise ValueError(f"{source} must be one of {BACKENDS}, got {choice!r}")
    return choice


def backend_for(op: str, device: torch.device | str, backend: str | None = None) -> str:
    """The implementation (``"triton"`` or ``"torch"``) that runs ``op`` on ``device``."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; known: {sorted(OPS)}")
    choice = requested_backend(backend)
    device = torch.device(device)
    triton_runs_here = TRITON_AVAILABLE and (device.type == "cuda" or (device.type == "cpu" and interpreting()))
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_runs_here:
            raise ValueError(
                f"backend='triton' cannot run {op} on device {device}: Triton needs a CUDA/ROCm device "
                "(or TRITON_INTERPRET=1 with CPU tensors) and an importable triton"
            )
        return "triton"
    if not triton_runs_here:
        return "torch"
    if device.type == "cpu":
        return "triton"
    name = arch(device)
    if name.startswith("rocm:") or name in OPS[op]:
        return "triton"
    _warn_unknown_arch(name)
    return "torch"
