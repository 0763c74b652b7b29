"""Processes for fastft's distributed tests and benchmark: each one rank of a ``torch.distributed`` process
group, started by ``torch.multiprocessing``, with every wait bounded.

    fastft.spawn.run(fn, (a, b), world=2, backend="gloo", timeout=300)   # fn(rank, a, b) on each rank

Each rank sets its own GPU first (NCCL: ``cuda:<rank>``, as ``torch.cuda.set_device(local_rank)`` does under
torchrun) and joins a group whose collectives time out after ``collective_timeout`` seconds. A rank that
raises writes its traceback and exits at once, without ``destroy_process_group`` (its peers may be waiting in
a collective it will never join, and a destroy would wait with them); ``run`` then stops the others and
raises with that traceback. Past ``timeout`` seconds ``run`` kills every rank and raises ``TimeoutError``.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time
import traceback

import torch

__all__ = ["run", "exit_spawned_worker"]

COLLECTIVE_TIMEOUT = 120.0  # seconds one collective may wait for the other ranks (gloo raises, NCCL aborts)
_GRACE = 5.0  # seconds the other ranks get to stop after one failed, before SIGTERM and then SIGKILL


def exit_spawned_worker() -> None:
    """End a ``torch.multiprocessing.spawn`` worker whose work is done and whose process group is destroyed:
    gloo's threads now and then abort the interpreter's teardown ("terminate called without an active
    exception"; torch 2.13 CPU, plain DDP on an ``nn.Linear`` too), which ``spawn`` reports as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(fn, args=(), *, world: int, backend: str, timeout: float, collective_timeout: float = COLLECTIVE_TIMEOUT):
    """``fn(rank, *args)`` in ``world`` spawned processes, rank ``r`` of one ``backend`` process group
    (``"gloo"``, or ``"nccl"`` on ``cuda:r``); returns once every rank returned. ``fn`` and ``args`` must
    pickle (a module-level function). Raises ``RuntimeError`` with the traceback of a rank that raised (the
    others stopped), ``TimeoutError`` when the ranks are still running after ``timeout`` seconds (all killed).
    ``ValueError`` for a ``world`` < 1, a ``backend`` other than those two, NCCL with fewer GPUs, or a
    ``timeout`` / ``collective_timeout`` that is not a positive number of seconds (checked before any rank
    starts)."""
    import math

    import torch.multiprocessing as mp

    for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"{world} NCCL ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="fastft-spawn-") as folder:
        entry_args = (fn, tuple(args), world, backend, folder, float(collective_timeout))
        context = mp.start_processes(_entry, args=entry_args, nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)), grace_period=_GRACE):
                if time.monotonic() >= deadline:
                    _kill(context.processes)
                    raise TimeoutError(
                        f"{world} ranks of {getattr(fn, '__name__', fn)} still ran after {timeout:.0f} s: killed"
                    )
        except mp.ProcessExitedException as e:
            errors = [os.path.join(folder, f"error.{r}") for r in range(world)]
            first = min((p for p in errors if os.path.exists(p)), key=os.path.getmtime, default=None)
            if first is None:
                raise
            with open(first) as f:
                raise RuntimeError(f"rank {first.rsplit('.', 1)[1]} failed:\n{f.read()}") from e


def _kill(processes) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join()


def _entry(rank, fn, args, world, backend, folder, collective_timeout) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device_id = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{os.path.join(folder, 'init')}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=collective_timeout),
            device_id=device_id,
        )
        fn(rank, *args)
    except BaseException:
        with open(os.path.join(folder, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no destroy_process_group: a peer waiting in a collective would hold it forever
    dist.destroy_process_group()
    exit_spawned_worker()
