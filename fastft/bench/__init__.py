"""The op micro-benchmarks: one module per op family, ``fastft/bench/<family>.py`` beside ``fastft/<family>.py``,
each with ``run(device, quick) -> list[Row]`` (``common``: the timing and the table they share). ``python -m
fastft bench`` runs them (``--only FAMILY``: some); the families whose Triton launch parameters ``python -m
fastft tune`` measures also have ``tune_launchers(device)``. The end-to-end benchmark is ``fastft.e2e``."""

from __future__ import annotations

import importlib
import pkgutil

# every module here but common, found rather than listed: a new op's benchmark is one new file
FAMILIES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "common"))


def modules(names=None) -> dict:
    """The benchmark modules of the families ``names`` (default all), by family, in the order given."""
    return {name: importlib.import_module(f"{__name__}.{name}") for name in (names or FAMILIES)}


def tuned() -> tuple[str, ...]:
    """The families ``python -m fastft tune`` measures (their modules have ``tune_launchers``)."""
    return tuple(name for name, module in modules().items() if hasattr(module, "tune_launchers"))
