"""Timing and reporting shared by the benchmark modules."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch


@dataclasses.dataclass
class Row:
    op: str  # what was measured
    shape: str  # the case, in words
    baseline: str  # what fastft is compared against
    baseline_ms: float | None  # median time of the baseline (None: not run, e.g. out of memory)
    fastft_ms: float  # median time of fastft
    backend: str  # backend that ran fastft
    note: str = ""  # a bound or check that goes with the numbers

    @property
    def speedup(self) -> float | None:
        return None if self.baseline_ms is None else self.baseline_ms / self.fastft_ms


def time_ms(fn, device: torch.device, *, rep_ms: int = 200) -> float:
    """Median milliseconds of ``fn()``: CUDA events via ``triton.testing.do_bench`` on a GPU; on CPU the wall clock
    of the calls after the first that fit in ``rep_ms``, or of the first alone where it takes longer than that
    (the interpreter's calls take seconds)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1000
    if first > rep_ms:
        return first
    times = []
    deadline = time.perf_counter() + rep_ms / 1000
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 100):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def peak_gib(fn, device: torch.device) -> float | None:
    """Peak memory ``fn()`` allocates above what is held before it, in GiB (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def copy_gbs(device: torch.device) -> float | None:
    """The device's copy bandwidth in GB/s (a 1 GiB clone, read + write counted): the floor of a
    bandwidth-bound kernel. None off CUDA."""
    if device.type != "cuda":
        return None
    buf = torch.empty(2**30, dtype=torch.uint8, device=device)
    return 2 * buf.numel() / (time_ms(lambda: buf.clone(), device) * 1e6)


def fwd_and_bwd(forwards: dict, leaves, grad, device, *, nbytes: dict, copy_bw: float | None, rep_ms: int):
    """Each of ``forwards`` (label -> function returning the output or a tuple of outputs, with ``grad`` a tuple
    then; ``"ours"`` among them) timed forward, then
    forward + backward (the gradient of ``leaves`` for ``grad``): ``[(mode, {label: ms}, {label: peak GiB or
    None}, note)]``, where the note gives ``"ours"``' bandwidth against the HBM floor: ``nbytes[mode]`` bytes at
    the device copy's ``copy_bw`` GB/s (``copy_gbs``; None: no note)."""
    results = []
    for mode in ("fwd", "fwd+bwd"):
        if mode == "fwd":
            fns = {k: (lambda f=f: _detached(f())) for k, f in forwards.items()}
        else:
            fns = {k: (lambda f=f: torch.autograd.grad(f(), leaves, grad)) for k, f in forwards.items()}
        ms = {k: time_ms(fn, device, rep_ms=rep_ms) for k, fn in fns.items()}
        peak = {k: peak_gib(fn, device) for k, fn in fns.items()}
        note = ""
        if copy_bw is not None:
            floor = nbytes[mode] / (copy_bw * 1e6)
            note = f"{nbytes[mode] / (ms['ours'] * 1e6):.0f} GB/s, {ms['ours'] / floor:.2f}x the HBM floor"
            note += f" ({floor:.3f} ms at copy bandwidth)"
        results.append((mode, ms, peak, note))
    return results


def _detached(out):
    return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()


def graph_ms(fn, *, rep_ms: int = 100) -> float:
    """Median GPU milliseconds of ``fn()`` replayed from a CUDA graph: device time without host launch cost."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def host_us(fn, iters: int = 200) -> float:
    """Median host microseconds of ``fn()`` (no device synchronisation: what the Python caller pays)."""
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def write_bandwidth_ms(nbytes: int, device: torch.device) -> float:
    """Median time to write ``nbytes`` with a fill: the floor for a kernel that must write them."""
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return time_ms(lambda: buf.fill_(1), device)


def format_table(rows: list[Row]) -> str:
    head = ("op", "shape", "baseline", "baseline ms", "fastft ms", "speedup", "backend", "note")
    body = [
        (
            r.op,
            r.shape,
            r.baseline,
            "-" if r.baseline_ms is None else f"{r.baseline_ms:.4f}",
            f"{r.fastft_ms:.4f}",
            "-" if r.speedup is None else f"{r.speedup:.1f}x",
            r.backend,
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["| " + " | ".join(str(x).ljust(w) for x, w in zip(line, widths)) + " |" for line in (head, *body)]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
