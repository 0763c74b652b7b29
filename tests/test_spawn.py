"""``fastft.spawn.run``, what the distributed tests run on: a rank that fails ends the run at once with its
traceback while the others wait for it in a collective, a run past its timeout is killed, and the arguments
are checked. gloo on CPUs; ``FASTFT_DIST_BACKEND=nccl FASTFT_DIST_WORLD=N`` on N GPUs."""

import os

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("needs torch.distributed", allow_module_level=True)

from fastft import spawn  # noqa: E402

BACKEND = os.environ.get("FASTFT_DIST_BACKEND", "gloo")
WORLD = int(os.environ.get("FASTFT_DIST_WORLD", "2"))
TIMEOUT = float(os.environ.get("FASTFT_DIST_TIMEOUT", "300"))

pytestmark = pytest.mark.distributed
if BACKEND == "gloo" and not dist.is_gloo_available():
    pytest.skip("needs gloo", allow_module_level=True)
if BACKEND == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
    pytest.skip(f"needs NCCL and {WORLD} GPUs ({torch.cuda.device_count()} here)", allow_module_level=True)


def failing_worker(rank):
    if BACKEND == "nccl":
        assert torch.cuda.current_device() == rank  # each rank on its own GPU
    if rank == dist.get_world_size() - 1:
        raise ValueError("this rank fails")
    device = torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")
    x = torch.ones(1, device=device)
    dist.all_reduce(x)  # the others wait for it here
    x.item()


def test_a_failing_rank_stops_the_others():
    """The last rank raises while the others wait in a collective for it: ``run`` raises its traceback at
    once (not after the collective's timeout), the others stopped."""
    with pytest.raises(RuntimeError, match=f"rank {WORLD - 1} failed:(.|\n)*ValueError: this rank fails"):
        spawn.run(failing_worker, world=WORLD, backend=BACKEND, timeout=TIMEOUT, collective_timeout=TIMEOUT)


def sleeping_worker(rank):
    import time

    time.sleep(600)


def test_a_hanging_run_is_killed():
    with pytest.raises(TimeoutError, match="still ran after 3 s: killed"):
        spawn.run(sleeping_worker, world=WORLD, backend=BACKEND, timeout=3)


def test_run_checks_its_arguments():
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        spawn.run(failing_worker, world=0, backend="gloo", timeout=1)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        spawn.run(failing_worker, world=1, backend="mpi", timeout=1)
    if torch.cuda.device_count() < 64:
        with pytest.raises(ValueError, match="64 NCCL ranks need 64 GPUs"):
            spawn.run(failing_worker, world=64, backend="nccl", timeout=1)
    for bad in (None, 0, -1.0, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ValueError, match="timeout must be a positive finite number of seconds"):
            spawn.run(failing_worker, world=1, backend="gloo", timeout=bad)
    with pytest.raises(ValueError, match="collective_timeout must be a positive finite number"):
        spawn.run(failing_worker, world=1, backend="gloo", timeout=5, collective_timeout=0)
