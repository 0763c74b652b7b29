"""What this machine's torch, Triton and GPUs can do: every capability probe of fastft, in one place."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os

import torch

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None

_arch_names: dict[int, str] = {}  # CUDA device index -> arch name (plain dicts: torch.compile traces them)


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _cuda_arch(index: int) -> str:
    if index not in _arch_names:
        if torch.version.hip is not None:
            _arch_names[index] = "rocm:" + torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
        else:
            major, minor = torch.cuda.get_device_capability(index)
            _arch_names[index] = f"sm{major}{minor}"
    return _arch_names[index]


def arch(device: torch.device | str | None = None) -> str:
    """``"sm90"``-style name for a CUDA device, ``"rocm:<gfx>"`` for ROCm, else the device type."""
    device = torch.device("cuda" if device is None and torch.cuda.is_available() else (device or "cpu"))
    if device.type != "cuda":
        return device.type
    return _cuda_arch(cuda_index(device))


def cuda_index(device: torch.device | str | int | None = None) -> int:
    """The index of a CUDA device (``cuda`` or None: the current one), the key of every per-device table."""
    if isinstance(device, int):
        return device
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.cuda.current_device() if device.index is None else device.index


_flash: dict[int, bool] = {}  # CUDA device index -> flash_attention's answer
_unified: dict[int, bool] = {}  # CUDA device index -> unified_memory's answer


def flash_attention(device: torch.device) -> bool:
    """Whether torch's flash attention kernels run on this CUDA device (NVIDIA sm80 and newer)."""
    index = cuda_index(device)
    if index not in _flash:
        _flash[index] = torch.version.hip is None and torch.cuda.get_device_capability(index) >= (8, 0)
    return _flash[index]


def unified_memory(device: torch.device) -> bool:
    """Whether this CUDA device shares its memory with the host (an integrated GPU: Jetson, GH200's not)."""
    index = cuda_index(device)
    if index not in _unified:
        _unified[index] = bool(torch.cuda.get_device_properties(index).is_integrated)
    return _unified[index]


@functools.cache
def varlen_attn():
    """torch's ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _block_mask_takes_q_tables() -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


# Whether ``BlockMask.from_kv_blocks`` can skip deriving the q tables (torch >= 2.7). A constant, so that
# torch.compile traces code that reads it without a cache wrapper.
BLOCK_MASK_TAKES_Q_TABLES = _block_mask_takes_q_tables()


def grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` multiplies these: CUDA bf16 with 16-byte aligned rows."""
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == weight.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0
        and weight.shape[-1] % 8 == 0
        and weight.shape[-2] % 8 == 0
    )
