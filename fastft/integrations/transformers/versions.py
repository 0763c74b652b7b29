"""What differs between the transformers releases fastft supports, in one place: the tested range, the
name of a forward's KV cache, and the method that turns checkpointing on.

- 5.17 to 5.23: the cache is ``past_key_values``; ``gradient_checkpointing_enable`` turns checkpointing on,
  and a checkpointed layer wraps ``__call__`` (its checkpoint function gets ``partial(module.__call__)``).
- 5.24: the cache is ``cache`` (``past_key_values`` is still taken); ``activation_checkpointing_enable``
  (``gradient_checkpointing_enable`` warns that it goes in v6); a checkpointed layer wraps ``forward`` (its
  checkpoint function gets ``partial(forward, module)``) and runs uncheckpointed without grad; only the
  outermost such wrapper of a class checkpoints, so fastft replaces the forward inside it
  (``layer_forward``/``set_layer_forward``), not the wrapper.
"""

from __future__ import annotations

import re
import warnings

OLDEST = (5, 17)  # the oldest release fastft's integration tests run on
NEWEST = (5, 24)  # the newest; the user extras allow releases up to it
CACHE_KWARGS = ("past_key_values", "cache")  # a forward's KV cache, by release

_warned: set = set()


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``"5.24.0"`` or ``"5.25.0.dev0"``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a transformers version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def tested_range() -> str:
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def check_version() -> None:
    """A ``UserWarning`` (once per version) when the installed transformers is outside the tested range."""
    import transformers

    version = transformers.__version__
    if OLDEST <= release(version) <= NEWEST or version in _warned:
        return
    _warned.add(version)
    warnings.warn(
        f"fastft's transformers integration is tested on transformers {tested_range()}; this is {version}. "
        "It may fail or mis-train there: install a tested release (pip install 'transformers>=5.17,<5.25')",
        UserWarning,
        stacklevel=3,
    )


def cache_of(kwargs: dict):
    """The KV cache a forward's keyword arguments hand it (None without one)."""
    for name in CACHE_KWARGS:
        cache = kwargs.get(name)
        if cache is not None:
            return cache
    return None


def enable_checkpointing(model, every_n_layers: int) -> None:
    """transformers' own checkpointing switch on ``model`` (non-reentrant, every ``every_n_layers``-th layer,
    input grads where transformers sets them), called on its class so that fastft's instance overrides are
    skipped; fastft then puts its checkpoint function on the layers."""
    cls = type(model)
    kwargs = {"use_reentrant": False}
    if hasattr(cls, "_activation_checkpointing_enable"):  # 5.24
        cls._activation_checkpointing_enable(model, kwargs, every_n_layers=every_n_layers)
    else:
        cls.gradient_checkpointing_enable(model, kwargs, every_n_layers=every_n_layers)


def _checkpointing_cell(cls):
    """The closure cell holding the forward inside transformers' checkpointing wrapper of ``cls.forward``
    (5.24's ``GradientCheckpointingLayer``), or None where ``cls.forward`` is the forward itself."""
    fn = cls.__dict__.get("forward")
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name != "forward_with_checkpointing" or "forward" not in code.co_freevars:
        return None
    return fn.__closure__[code.co_freevars.index("forward")]


def layer_forward(cls):
    """The forward a layer class runs: ``cls.forward``, or the one inside transformers' checkpointing wrapper."""
    cell = _checkpointing_cell(cls)
    return cls.forward if cell is None else cell.cell_contents


def set_layer_forward(cls, fn) -> None:
    """Make ``fn`` the forward ``layer_forward(cls)`` gives. Inside transformers' checkpointing wrapper it stays
    outermost (a wrapper replacing it would never checkpoint), and the checkpoint's recomputation, which
    calls the inner forward, runs ``fn`` too."""
    cell = _checkpointing_cell(cls)
    if cell is None:
        cls.forward = fn
    else:
        cell.cell_contents = fn
