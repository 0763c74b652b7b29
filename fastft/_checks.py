"""Argument checks shared by fastft's public entries: ``TypeError`` for a wrong type, ``ValueError`` for a
wrong value, each naming the argument."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def int_arg(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as an int: ``TypeError`` unless it is an integer (bools are not), ``ValueError`` below
    ``minimum``."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


def bool_arg(name: str, value) -> bool:
    """``value`` itself: ``TypeError`` unless it is a bool (a truthy string is not ``True``)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def number_arg(name: str, value) -> float:
    """``value`` as a float: ``TypeError`` unless it is a real number (bools are not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def finite_arg(name: str, value) -> float:
    """``value`` as a finite float: ``TypeError`` unless it is a real number, ``ValueError`` if not finite."""
    value = number_arg(name, value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def float_tensor_arg(name: str, value, device, first: str, shape=None, what: str | None = None) -> None:
    """``TypeError`` unless ``value`` is a tensor; ``ValueError`` unless it is floating, on ``device`` (that of
    the op's first argument, named ``first``) and, where ``shape`` is given, of that shape (``what`` spells it)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise ValueError(f"{name} must have a floating dtype, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but {first} is on {device}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must be {what} = {tuple(shape)}, got {tuple(value.shape)}")
