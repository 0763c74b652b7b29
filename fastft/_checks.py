"""Argument checks shared by fastft's public entries: ``TypeError`` for a wrong type, ``ValueError`` for a
wrong value, each naming the argument."""

from __future__ import annotations

import math
import numbers

import numpy as np


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
