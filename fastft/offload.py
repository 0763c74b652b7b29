"""Offloaded gradient checkpointing: each checkpointed layer keeps only its input, in pinned host memory.

    y = fastft.offloaded_checkpoint(layer, x, *other_args, **kwargs)
    # == torch.utils.checkpoint.checkpoint(layer, x, *other_args, use_reentrant=False, **kwargs),
    #    except that x (the first positional tensor) waits for backward in pinned host memory

How: torch's non-reentrant checkpoint saves its inputs for the recomputation; a saved-tensor hook around
it sends ``x`` to the host on a side stream (``fastft.offloader.Offloader``) and, when backward needs it, copies
it back into one of two GPU buffers. When layer ``i``'s backward starts, the reload of the previous
checkpoint in forward order (the next one backward needs) is issued into the other buffer, so that copy
runs while layer ``i`` recomputes and back-propagates. Recomputation, RNG state and gradients are
torch's own, so results are bit-identical to ``torch.utils.checkpoint``.

Plain recompute checkpointing is used instead where offload does not pay: grad disabled (the function
just runs), no tensor argument, a CPU tensor, an input under ``min_bytes``, or (with ``enabled="auto"``)
a GPU that shares memory with the host.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch
import torch.utils.checkpoint

from . import capabilities
from ._checks import int_arg
from .offloader import Offloader

__all__ = [
    "OffloadConfig",
    "offloaded_checkpoint",
    "offloader_for",
    "check_offload_config",
    "gradient_checkpointing_func",
]

_CHOICES = ("auto", True, False)
_DEFAULT_MIN_BYTES = 1 << 20


def _env_choice(name: str):
    value = os.environ.get(name)
    if value is None:
        return None
    parsed = {"auto": "auto", "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}.get(
        value.lower()
    )
    if parsed is None:
        raise ValueError(f"{name} must be one of auto, 1, 0 (or true/false, on/off), got {value!r}")
    return parsed


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """How ``offloaded_checkpoint`` offloads. A field left ``None`` takes its environment variable, else
    its default.

    - ``enabled``: ``"auto"`` (default; offload on discrete GPUs), ``True`` (also on GPUs that share
      memory with the host), ``False`` (plain recompute checkpointing). Env ``FASTFT_OFFLOAD``.
    - ``double_buffer``: ``"auto"`` (default; on, except on GPUs that share memory with the host),
      ``True``, ``False`` (one GPU buffer: each reload waits for the previous layer's backward).
      Env ``FASTFT_OFFLOAD_DOUBLE_BUFFER``.
    - ``min_bytes``: inputs smaller than this are not offloaded (default 1 MiB, e.g. 128 tokens x 4096
      bf16 features). Env ``FASTFT_OFFLOAD_MIN_BYTES``.
    """

    enabled: bool | str | None = None
    double_buffer: bool | str | None = None
    min_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("enabled", "double_buffer"):
            value = getattr(self, name)
            if value is not None and not any(value is c for c in _CHOICES) and value != "auto":
                raise ValueError(f"{name} must be 'auto', True or False (or None), got {value!r}")
        if self.min_bytes is not None:
            int_arg("min_bytes", self.min_bytes, minimum=0)

    def resolve(self) -> tuple:
        """(enabled, double_buffer, min_bytes) after the environment and the defaults."""
        enabled = self.enabled if self.enabled is not None else _env_choice("FASTFT_OFFLOAD")
        double = self.double_buffer if self.double_buffer is not None else _env_choice("FASTFT_OFFLOAD_DOUBLE_BUFFER")
        min_bytes = self.min_bytes
        if min_bytes is None:
            raw = os.environ.get("FASTFT_OFFLOAD_MIN_BYTES")
            try:
                min_bytes = _DEFAULT_MIN_BYTES if raw is None else int(raw)
            except ValueError:
                raise ValueError(f"FASTFT_OFFLOAD_MIN_BYTES must be an int, got {raw!r}") from None
        return ("auto" if enabled is None else enabled), ("auto" if double is None else double), min_bytes


def check_offload_config(value, name: str = "offload_config") -> OffloadConfig | None:
    """``value`` if it is an ``OffloadConfig`` or None, else ``TypeError`` naming the argument ``name``."""
    if value is not None and not isinstance(value, OffloadConfig):
        raise TypeError(f"{name} must be a fastft.OffloadConfig or None, got {type(value).__name__}")
    return value


_offloaders: dict = {}  # (device index, number of GPU buffers) -> Offloader


def offloader_for(x, config: OffloadConfig | None = None) -> Offloader | None:
    """The ``Offloader`` that ``offloaded_checkpoint`` would use for layer input ``x``, or None when it
    would checkpoint without offloading."""
    check_offload_config(config)
    enabled, double, min_bytes = (config or OffloadConfig()).resolve()
    if enabled is False or not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return None
    if x.numel() * x.element_size() < min_bytes:
        return None
    unified = capabilities.unified_memory(x.device)
    if enabled == "auto" and unified:
        return None
    buffers = 2 if (double is True or (double == "auto" and not unified)) else 1
    key = (capabilities.cuda_index(x.device), buffers)
    if key not in _offloaders:
        _offloaders[key] = Offloader(torch.device("cuda", key[0]), buffers)
    return _offloaders[key]


class OffloadedInput:
    """A checkpoint's input offloaded to host memory by ``offloader``; ``unpack()`` brings it back for the
    recomputation and starts the reload of the input offloaded just before it (backward's next) into the
    Offloader's other buffer."""

    def __init__(self, x: torch.Tensor, offloader: Offloader) -> None:
        self.offloader = offloader
        self.host = offloader.offload(x)

    def unpack(self) -> torch.Tensor:
        off = self.offloader
        off.release_finished()
        x = off.reload(self.host).wait()
        prev = self.host.previous()  # the previous checkpoint's input in forward order: backward's next
        if off.num_buffers > 1 and prev is not None:
            off.reload(prev)  # prefetch into the other buffer while this layer recomputes
        return x


def offloaded_checkpoint(
    function,
    *args,
    preserve_rng_state: bool = True,
    offload_config: OffloadConfig | None = None,
    use_reentrant: bool | None = None,
    context_fn=None,
    determinism_check: str = "default",
    debug: bool = False,
    **kwargs,
):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` whose first
    positional tensor argument waits for backward in pinned host memory (see the module docstring).

    ``context_fn``, ``determinism_check`` and ``debug`` go to torch's checkpoint; other keyword arguments
    go to ``function``. ``use_reentrant=True`` is refused: the offload is built on the non-reentrant one.
    """
    if use_reentrant:
        raise ValueError("offloaded_checkpoint is non-reentrant; use_reentrant must be False or None")
    check_offload_config(offload_config)
    options = dict(
        use_reentrant=False, preserve_rng_state=preserve_rng_state, determinism_check=determinism_check, debug=debug
    )
    if context_fn is not None:
        options["context_fn"] = context_fn
    if not torch.is_grad_enabled():  # no_grad / inference_mode: nothing is saved, nothing to offload
        return function(*args, **kwargs)
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    offloader = offloader_for(x, offload_config)
    if offloader is None:
        return torch.utils.checkpoint.checkpoint(function, *args, **options, **kwargs)
    saved: list[OffloadedInput] = []
    x_ref = weakref.ref(x)  # autograd keeps the pack hook with each saved tensor: it must not keep x alive

    def pack(t):
        if t is not x_ref():
            return t
        if not saved:
            saved.append(OffloadedInput(t, offloader))
        return saved[0]

    def unpack(obj):
        return obj.unpack() if isinstance(obj, OffloadedInput) else obj

    # Outside the checkpoint's own hooks these see only the inputs the checkpoint saves for recomputation.
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return torch.utils.checkpoint.checkpoint(function, *args, **options, **kwargs)


def gradient_checkpointing_func(function, *args, **kwargs):
    """``offloaded_checkpoint`` with the default (environment) configuration, as a framework's checkpoint
    function (``fastft.integrations.transformers.enable_gradient_checkpointing`` sets it on a model)."""
    return offloaded_checkpoint(function, *args, **kwargs)
