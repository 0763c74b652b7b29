"""Compile, for real GPUs, every Triton kernel launch the CPU test suite makes in Triton's interpreter.

The interpreter runs a kernel's Python on NumPy: it never builds the kernel for a GPU, so a kernel that the
compiler rejects (a dot below 16 wide, a constexpr branch that does not type-check) passes every CPU test.
This script closes that gap without a GPU: Triton's compiler and ptxas run on any machine. (What only a GPU
checks stays the GPU tests' business: resources at load time, such as shared memory, and what the code
computes.)

    python3 scripts/compile_kernels.py record LAUNCHES -- [pytest arguments]
        runs pytest (the interpreter) and writes each distinct launch to the JSON file LAUNCHES: the kernel,
        each argument's type (a tensor's dtype and 16-byte alignment, an int's width, a constexpr's value)
        and num_warps / num_stages;
    python3 scripts/compile_kernels.py compile LAUNCHES [--arch 90 80] [--jobs N]
        compiles the recorded launches (per kernel, dtypes and flags, the one with the smallest sizes) to cubins
        for each CUDA architecture (sm_90: H100/H200; sm_80: A100) with the installed Triton,
        and exits 1, naming the kernel, the launch and the compiler's error, if any does not compile.

scripts/test.sh does both, for sm_90 and sm_80, on a machine without a GPU. Another Triton release (the one a GPU
machine's torch pins) compiles the same file from its own directory:
``pip install --no-deps --target DIR triton==X`` then ``PYTHONPATH=DIR python3 scripts/compile_kernels.py
compile LAUNCHES``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import inspect
import json
import os
import sys
import time
import warnings

# ---- recording (a pytest plugin, loaded by ``record``) ----------------------------------------------------


def _representative(value):
    """What Triton's launcher specializes a runtime argument on, as JSON: a tensor's dtype and 16-byte alignment;
    an int's value where it is 1, else its width and divisibility by 16 (a stand-in of the same class); any
    float (fp32); a bool, None or string as itself."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, int) and not isinstance(value, bool) and value != 1:
        wide = not -(2**31) <= value < 2**31
        return (2**32 if wide else 16) + (value % 16 != 0)
    if isinstance(value, float):
        return 0.5
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"scripts/compile_kernels.py records no kernel argument of type {type(value).__name__}")


class Recorder:
    """Records every interpreted launch's kernel and argument classes (a pytest plugin)."""

    def __init__(self, path: str):
        self.path = path
        self.launches: dict[str, dict] = {}

    def pytest_configure(self, config):
        from triton.runtime.interpreter import InterpretedFunction

        real, recorder = InterpretedFunction.run, self

        def run(fn, *args, grid, warmup, **kwargs):
            recorder.add(fn.fn, args, kwargs)
            return real(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run

    def add(self, fn, args, kwargs) -> None:
        params = inspect.signature(fn).parameters
        bound = dict(zip(params, args), **kwargs)

        def runtime(name):  # a runtime argument (not a constexpr, nor a launch option such as num_warps)
            return name in params and "constexpr" not in str(params[name].annotation)

        launch = {
            "module": fn.__module__,
            "kernel": fn.__name__,
            "args": {name: _representative(v) if runtime(name) else v for name, v in bound.items()},
        }
        try:
            key = json.dumps(launch, sort_keys=True)
        except TypeError as e:
            raise TypeError(f"scripts/compile_kernels.py: {fn.__name__}'s constexprs are not JSON: {e}") from None
        self.launches.setdefault(key, launch)

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump(sorted(self.launches.values(), key=lambda x: (x["module"], x["kernel"])), f, indent=0)


# ---- compiling ---------------------------------------------------------------------------------------------


class _Target:
    """A stand-in for Triton's active driver: a CUDA GPU of one architecture, which ``warmup`` compiles for
    (nothing is launched, so no GPU is needed)."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def _stand_in(value):
    import torch

    if isinstance(value, dict):
        dtype = getattr(torch, value["tensor"])
        return torch.empty(32, dtype=dtype) if value["aligned"] else torch.empty(33, dtype=dtype)[1:]
    return value


def _compile_one(job) -> str | None:
    """Compile one launch for one architecture with Triton's own launcher (``warmup``): None, or the error."""
    launch, arch = job
    from triton.runtime import driver

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")  # Triton 3.9's note on a default
    driver.set_active(_Target(arch))
    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    try:
        fn.warmup(grid=(1,), **{name: _stand_in(value) for name, value in launch["args"].items()})
    except Exception as e:  # the compiler's own error, whatever its type
        lines = str(e).strip().splitlines()
        return f"{launch['module']}.{launch['kernel']} on sm_{arch}, launch {json.dumps(launch)}:\n  " + "\n  ".join(
            lines[-12:]
        )
    return None


def _representatives(launches: list[dict]) -> list[dict]:
    """The launches to compile: per kernel and mode (its tensors' dtypes, and its flags: the constexprs that are
    bools, strings, None or ints never above 2, such as ``GATE``), the launch with the smallest sizes (the other
    ints: block sizes, stages, warps, runtime ints). A compile error follows the code that a kernel's flags and
    dtypes select, or a size below a minimum (a dot under 16 wide); the interpreter's large tiles are not the
    GPU's (they run with one warp: a 64k-element tile is minutes of ptxas), and its sizes are too many to
    compile each."""
    flags: dict[tuple, bool] = {}
    for launch in launches:
        for name, value in launch["args"].items():
            key = (launch["module"], launch["kernel"], name)
            flags[key] = flags.get(key, True) and not (type(value) is int and (value > 2 or name[0].islower()))

    smallest: dict[str, tuple] = {}
    for launch in launches:
        mode, size = {}, 0
        for name, value in launch["args"].items():
            if flags[launch["module"], launch["kernel"], name]:
                mode[name] = value["tensor"] if isinstance(value, dict) else value
            elif type(value) is int:
                size += value
        key = json.dumps([launch["module"], launch["kernel"], mode], sort_keys=True)
        if key not in smallest or size < smallest[key][0]:
            smallest[key] = (size, launch)
    return [launch for _, launch in smallest.values()]


def compile_all(path: str, archs: list[int], jobs: int) -> int:
    with open(path) as f:
        recorded = json.load(f)
    launches = _representatives(recorded)
    work = [(launch, arch) for launch in launches for arch in archs]
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        failures = [f for f in pool.map(_compile_one, work) if f]
    kernels = len({(x["module"], x["kernel"]) for x in launches})
    print(
        f"compiled {len(work) - len(failures)} of {len(work)} kernel builds for sm_{'/sm_'.join(map(str, archs))}: "
        f"{kernels} kernels, {len(launches)} of the {len(recorded)} distinct launches recorded, "
        f"{time.perf_counter() - start:.0f} s"
    )
    for failure in failures:
        print("FAILED", failure)
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run pytest in Triton's interpreter and record its kernel launches")
    rec.add_argument("launches")
    rec.add_argument("pytest_args", nargs=argparse.REMAINDER)
    comp = sub.add_parser("compile", help="compile the recorded launches for CUDA GPUs")
    comp.add_argument("launches")
    comp.add_argument("--arch", type=int, nargs="+", default=[90, 80])
    comp.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    if args.command == "record":
        os.environ["TRITON_INTERPRET"] = "1"
        import pytest

        pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
        return int(pytest.main(pytest_args, plugins=[Recorder(os.path.abspath(args.launches))]))
    os.environ.pop("TRITON_INTERPRET", None)
    return compile_all(args.launches, args.arch, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
