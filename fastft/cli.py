"""What the commands of ``python -m fastft`` share: argument types, the device in words, the environment a
command runs its backend in, and the one JSON writer (``fastft.__main__`` assembles the commands)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys

import torch


def device_arg(name: str) -> str:
    """argparse type of --device: a torch device that exists here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"not a torch device: {name!r} ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: this torch sees no CUDA device")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{name}: only {torch.cuda.device_count()} CUDA device(s) here")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{name}: fastft's CLI runs on cpu or cuda devices")
    return name


def device_of(name: str | None) -> torch.device:
    """The device of ``--device`` (default: cuda if available, else cpu)."""
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def positive(kind):
    """argparse type: a ``kind`` (int or float) above 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def json_path(path: str) -> str:
    """argparse type of --json: a file this user can write, checked before the run (a failed write at its end
    would lose the run's results)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{path}: the folder {folder} does not exist")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path}: not a file this user can write")
    return path


def versions() -> dict:
    """Python, torch, Triton (None: not installed) and fastft versions."""
    import fastft

    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "fastft": fastft.__version__,
    }


def fastft_runs(device: torch.device) -> str:
    """What fastft's ops run on ``device`` in this process, in words."""
    from fastft import capabilities, dispatch

    choice = dispatch.requested_backend()
    if choice == "torch":
        return "fastft's torch paths" + (" (FASTFT_BACKEND=torch)" if device.type == "cuda" else "")
    if device.type == "cuda":
        return "fastft's Triton kernels" + (" (FASTFT_BACKEND=triton)" if choice == "triton" else "")
    if capabilities.interpreting():
        return "fastft's Triton kernels in Triton's interpreter"
    return "fastft's torch paths"


def device_name(device: torch.device) -> str:
    """The device in words: ``NVIDIA H100 80GB HBM3 (sm90)``, ``x86_64 CPU``."""
    from fastft import capabilities

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({capabilities.arch(device)})"
    return f"{platform.processor() or platform.machine()} CPU"


def describe(device: torch.device) -> str:
    """The device in words, with what fastft runs on it."""
    return f"{device_name(device)}, {fastft_runs(device)}"


@contextlib.contextmanager
def environment(**values: str | None):
    """The environment variables ``values`` set (None: left as they are) for the block, and put back after it
    (a command called in-process, as the tests do, leaves no setting behind)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: value for key, value in values.items() if value is not None})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def interpreter_on_cpu(device: torch.device) -> dict:
    """The environment that runs fastft's Triton kernels on ``device``: Triton's interpreter on a CPU."""
    return {"TRITON_INTERPRET": "1" if device.type != "cuda" else None}


def prog() -> str:
    """The command as the user typed it: the ``fastft`` console script or ``python -m fastft``."""
    return "fastft" if os.path.basename(sys.argv[0] or "") == "fastft" else "python -m fastft"


def write_json(path: str, device: torch.device, rows: list) -> None:
    """The command's ``rows`` to ``path`` with the date, device, what fastft ran, versions and command line."""
    record = {
        "date": datetime.date.today().isoformat(),
        "device": device_name(device),
        "fastft_runs": fastft_runs(device),
        "versions": versions(),
        "command": " ".join([prog(), *map(shlex.quote, sys.argv[1:])]),  # as a shell takes it again
        "rows": rows,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path}")
