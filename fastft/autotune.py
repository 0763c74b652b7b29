"""Launch parameters per op and shape bucket, read from ``autotune_cache/<arch>.json``.

File layout::

    {"arch": "sm90", "device": "...", "date": "...", "versions": {...},
     "ops": {"packing.sdpa_mask": {"16384": {"BLOCK_Q": 32, "BLOCK_K": 256, "num_warps": 4}, ...}}}

A bucket is the size rounded up to a power of two. ``lookup`` takes the entry of the size's bucket, else
of the nearest bucket of that op, else the op's defaults. Each op module registers its ``Tunable`` here
(defaults, the sizes to measure, the candidate grid) beside the op; ``python -m fastft tune`` iterates
``TUNABLES`` and rewrites the file for the present GPU. ``FASTFT_AUTOTUNE_CACHE`` names another folder.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from pathlib import Path

import torch

from . import capabilities
from .kernels._launch import next_power_of_2

__all__ = ["lookup", "params", "cache_dir", "cache_path"]

_PACKAGE_DIR = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Tunable:
    """One kernel's launch parameters: what it runs with and what ``tune`` tries."""

    defaults: dict  # launch parameters when the cache has no entry
    sizes: tuple = ()  # sizes (the lookup key: elements, or row width for row ops) that tune measures
    grid: dict = dataclasses.field(default_factory=dict)  # parameter -> candidate values (tune tries all)
    # overrides of ``defaults`` in Triton's interpreter on CPU (tests): small tiles, so that small inputs
    # still span several programs, and few enough programs to run quickly
    interpreter: dict = dataclasses.field(default_factory=dict)

    def candidates(self) -> list[dict]:
        keys = list(self.grid)
        return [dict(zip(keys, values)) for values in itertools.product(*self.grid.values())]


TUNABLES: dict[str, Tunable] = {}  # op -> its Tunable; each op module registers its own


def register(op: str, tunable: Tunable) -> str:
    TUNABLES[op] = tunable
    return op


def cache_dir() -> Path:
    if "FASTFT_AUTOTUNE_CACHE" in os.environ:
        return Path(os.environ["FASTFT_AUTOTUNE_CACHE"])
    installed = _PACKAGE_DIR / "autotune_cache"  # wheel: the folder ships inside the package
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / "autotune_cache"


def cache_path(arch: str) -> Path:
    return cache_dir() / f"{arch.replace(':', '_')}.json"


bucket = next_power_of_2  # a size's bucket: the size rounded up to a power of two


@functools.cache
def _load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f).get("ops", {})
    except FileNotFoundError:
        return {}


_memo: dict = {}  # (op, arch, bucket, cache folder override) -> lookup's answer


def lookup(op: str, device: torch.device, size: int) -> tuple[dict, bool]:
    """(launch parameters, whether they came from the cache) for ``op`` at ``size`` on ``device``."""
    key = (op, capabilities.arch(device), bucket(size), os.environ.get("FASTFT_AUTOTUNE_CACHE"))
    hit = _memo.get(key)
    if hit is None:
        hit = _memo[key] = _lookup(op, device, key[1], key[2])
    return dict(hit[0]), hit[1]


def params(op: str, device: torch.device, size: int) -> dict:
    """The launch parameters ``lookup`` chooses, without the cache-hit flag."""
    return lookup(op, device, size)[0]


def _lookup(op: str, device: torch.device, arch: str, want: int) -> tuple[dict, bool]:
    defaults = TUNABLES[op].defaults
    if device.type == "cpu":
        defaults = {**defaults, **TUNABLES[op].interpreter}
    entries = _load(str(cache_path(arch))).get(op)
    if not entries:
        return dict(defaults), False
    key = min(entries, key=lambda k: (abs(math.log2(int(k)) - math.log2(want)), int(k)))
    return {**defaults, **entries[key]}, True


def write(arch: str, ops: dict, meta: dict) -> Path:
    path = cache_path(arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"arch": arch, **meta, "ops": ops}, f, indent=1, sort_keys=True)
        f.write("\n")
    _load.cache_clear()
    _memo.clear()
    return path
