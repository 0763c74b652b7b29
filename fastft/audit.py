"""``fastft.audit(step)``: where a training step's time goes between the kernels.

    report = fastft.audit(lambda: model(**batch).loss.backward(), model=model, layers=model.model.layers)
    print(report)

Runs ``step`` under ``torch.profiler`` (after ``warmup`` unprofiled calls) and reports, per step: wall time,
kernel time and the GPU-busy fraction (the union of kernel intervals over the wall time), work
submissions ("launches": kernel launches, copies and memsets on CUDA; top-level aten calls on a CPU, where
nothing is launched), host syncs and the aten op each came from, why the compute stream (the one with the
most kernel time) sat idle: each gap between its work is charged to work on another stream covering the gap's
middle (a copy it waits for), else to where the host was (the innermost profiled range on any host thread: the
module or autograd node, and the op or Python between ops), and the top launch sources: the innermost
module class for forward work (recompute included), the autograd node for backward work. Each module of
``layers`` (a model's decoder layers) gets its own row (forward and recompute: backward work runs outside
any module). ``python -m fastft audit`` does this for the end-to-end benchmark's step, its decoder layers
found by the transformers integration: this module knows no model library.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import os
import re
import sys
import tempfile

import torch

from ._checks import is_int

_SUBMIT = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset", "hipLaunch", "hipMemcpy")
_SYNC = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "hipStreamSynchronize")
_STEP, _WAIT, _LAYER = "fastft.audit step", "fastft.audit drain", "fastft.audit layer "
_MODULE, _BACKWARD = "fastft.audit module ", "autograd::"


@dataclasses.dataclass
class AuditReport:
    """Per-step averages over the profiled steps (times in ms); see the module docstring."""

    device: str
    steps: int
    wall_ms: float
    kernel_ms: float | None  # None without a GPU
    busy: float | None  # GPU-busy fraction of the wall time
    launches: float
    syncs: float
    sync_sources: list  # [(aten op, syncs per step)]
    top_sources: list  # [(module class or autograd node, launches per step)]
    idle_ms: float | None  # the compute stream's idle time; None without a GPU
    idle_sources: list  # [(side-stream work or where the host was, ms of that idle per step)]
    layers: list  # [{"layer": i, "launches": per step, "host_ms": per step, "kernel_ms": per step or None}]

    def __str__(self) -> str:
        what = "kernel launches, copies and memsets" if self.kernel_ms is not None else "top-level aten calls"
        lines = [
            f"audit on {self.device}, {self.steps} profiled steps (per step):",
            f"  wall {self.wall_ms:.2f} ms"
            + (
                f", kernels {self.kernel_ms:.2f} ms, GPU busy {self.busy:.0%}"
                if self.kernel_ms is not None
                else " (no GPU: no kernel time)"
            ),
            f"  launches {self.launches:.0f} ({what}), host syncs {self.syncs:g}",
        ]
        for source, n in self.sync_sources:
            lines.append(f"    sync from {source}: {n:g}")
        if self.idle_ms is not None:
            lines.append(f"  compute stream idle {self.idle_ms:.2f} ms, during:")
            lines += [f"    {ms:8.2f} ms  {where}" for where, ms in self.idle_sources]
        lines.append("  top launch sources:")
        lines += [f"    {n:8.0f}  {source}" for source, n in self.top_sources]
        if self.layers and not any(row["launches"] for row in self.layers):
            lines.append("  decoder layers: no module code ran in them (CUDA graph replays, counted above)")
        elif self.layers:
            lines.append("  decoder layers (forward and recompute):")
            for row in self.layers:
                kernel = f", kernels {row['kernel_ms']:.3f} ms" if row["kernel_ms"] is not None else ""
                launches, host = row["launches"], row["host_ms"]
                lines.append(f"    layer {row['layer']:3d}: {launches:6.0f} launches, host {host:.3f} ms{kernel}")
        return "\n".join(lines)


class _Ranges:
    """Forward hooks that put each module call of ``model`` and each of ``layers`` in a profiler range."""

    def __init__(self, model, layers: list) -> None:
        self.handles, self.open = [], collections.defaultdict(list)
        index = {id(m): i for i, m in enumerate(layers)}
        modules = list(model.modules()) if model is not None else []
        hooked = {id(m) for m in modules}
        for module in modules + [m for m in layers if id(m) not in hooked]:
            name = _MODULE + type(module).__name__
            names = [name] + ([_LAYER + str(index[id(module)])] if id(module) in index else [])
            self.handles.append(module.register_forward_pre_hook(self._enter(names)))
            self.handles.append(module.register_forward_hook(self._exit(names), always_call=True))

    def _enter(self, names):
        def hook(module, args):
            for name in names:
                rf = torch.autograd.profiler.record_function(name)
                rf.__enter__()
                self.open[id(module)].append(rf)

        hook.profiler_range_only = True  # fastft.graphs captures layers with these hooks all the same
        return hook

    def _exit(self, names):
        def hook(module, args, output):
            for _ in names:
                self.open[id(module)].pop().__exit__(None, None, None)

        hook.profiler_range_only = True
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _ancestors(event):
    while event is not None:
        yield event
        event = event.cpu_parent


def _source(event) -> str:
    """The innermost module range or autograd node above ``event``."""
    for e in _ancestors(event):
        if e.name.startswith(_MODULE):
            return e.name[len(_MODULE) :]
        if e.name.startswith(_BACKWARD):
            return "backward: " + e.name.rsplit(": ", 1)[-1]
    return "outside any module"


def _stream(event):
    return getattr(event, "device_resource_id", None)


def _idle_sources(host_events, spans, windows, side=()) -> collections.Counter:
    """Idle ms of a stream by cause: each gap between its ``spans`` (us) inside the step ``windows`` is
    charged to a ``side`` span ``(start, end, name)`` of other streams covering its middle, else to the
    innermost of ``host_events`` (nested per thread) covering it."""
    gaps = []
    for lo, hi in windows:
        end = lo
        for a, b in sorted((max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo):
            if a > end:
                gaps.append((end, a))
            end = max(end, b)
        if hi > end:
            gaps.append((end, hi))
    stacks = collections.defaultdict(list)  # thread -> open events, outermost first
    pending = sorted(host_events, key=lambda e: (e.time_range.start, -e.time_range.end))
    side, running, j = sorted(side), [], 0  # running: a heap of the side spans begun, by end
    charged, i = collections.Counter(), 0
    for a, b in sorted(gaps):
        mid = (a + b) / 2
        while j < len(side) and side[j][0] <= mid:
            heapq.heappush(running, (side[j][1], side[j][2]))
            j += 1
        while running and running[0][0] <= mid:
            heapq.heappop(running)
        if running:
            charged["another stream: " + running[0][1][:80]] += (b - a) / 1000
            continue
        while i < len(pending) and pending[i].time_range.start <= mid:
            e = pending[i]
            stack = stacks[e.thread]
            while stack and stack[-1].time_range.end <= e.time_range.start:
                stack.pop()
            stack.append(e)
            i += 1
        inner = None
        for stack in stacks.values():
            while stack and stack[-1].time_range.end <= mid:
                stack.pop()
            if stack and (inner is None or _length(stack[-1]) < _length(inner)):
                inner = stack[-1]
        charged[_where(inner)] += (b - a) / 1000
    return charged


def _length(event) -> float:
    return event.time_range.end - event.time_range.start


def _where(event) -> str:
    """``_source`` of a host event and the op it is in (its outermost op outside any module or autograd
    node; Python between ops where the innermost range is a module's or a node's)."""
    if event is None:
        return "no profiled range (Python outside the step's ops)"
    chain = list(_ancestors(event))
    owner = next((i for i, e in enumerate(chain) if e.name.startswith((_MODULE, _BACKWARD, _STEP))), len(chain))
    if owner == 0:
        op = "Python between ops"
    else:
        ops = [e for e in chain[:owner] if not e.name.startswith(_LAYER)]
        op = ops[-1].name if ops else "Python between ops"
    return f"{_source(event)}: {op}"


def _layers_arg(layers) -> list:
    """``layers`` as a list of distinct modules (``TypeError``/``ValueError`` naming ``layers``)."""
    if isinstance(layers, torch.nn.Module) and not isinstance(layers, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise TypeError(
            f"layers must be an iterable of torch.nn.Module (e.g. a ModuleList), got {type(layers).__name__}"
        )
    try:
        layers = list(layers)
    except TypeError:
        raise TypeError(f"layers must be an iterable of torch.nn.Module, got {type(layers).__name__}") from None
    for i, m in enumerate(layers):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"layers[{i}] must be a torch.nn.Module, got {type(m).__name__}")
    if len({id(m) for m in layers}) != len(layers):
        raise ValueError("layers must not hold the same module twice")
    return layers


def _union_ms(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > max(a, end):  # an event the profiler closed before it opened adds nothing
            total += b - max(a, end)
            end = b
    return total / 1000


def _synchronize() -> None:
    """Wait for every GPU: a model split over GPUs (``device_map``) computes on others than the current one."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


_KINETO_LOG = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] ")  # libkineto's own progress lines


@contextlib.contextmanager
def _without_profiler_log():
    """The profiler's own start and stop log lines (libkineto's ``USDT:``/``STAGE:`` lines on file descriptor
    2, which ``KINETO_LOG_LEVEL`` silences only when set before torch loads) left out of the process's stderr;
    whatever else is written to it meanwhile is passed on."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2: nothing to keep clean
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not _KINETO_LOG.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def audit(step, *, model=None, layers=(), steps: int = 3, warmup: int = 1, top: int = 10) -> AuditReport:
    """Profile ``step()`` (a callable running one training step) ``steps`` times after ``warmup`` calls; see
    the module docstring. ``model``: the model ``step`` trains, for per-module sources; ``layers``: modules
    (its decoder layers, e.g. ``model.model.layers``) that each get a row. ``TypeError`` for a non-callable
    ``step``, a ``model`` that is not an ``nn.Module``, ``layers`` that is not an iterable of them, or non-int
    counts; ``ValueError`` for a module repeated in ``layers``, ``steps`` or ``top`` below 1 or a negative
    ``warmup``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if not callable(step):
        raise TypeError(f"step must be a callable running one training step, got {type(step).__name__}")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    layers = _layers_arg(layers)
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0), ("top", top, 1)):
        if not is_int(value):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")
    steps, warmup, top = int(steps), int(warmup), int(top)
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        step()
    if cuda:
        _synchronize()
    ranges = _Ranges(model, layers)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    try:
        with _without_profiler_log():
            prof.__enter__()
        try:
            for _ in range(steps):
                with record_function(_STEP):  # the wall time includes draining the GPU's queue, not its sync
                    step()
                    if cuda:
                        with record_function(_WAIT):
                            _synchronize()
        finally:
            with _without_profiler_log():
                prof.__exit__(None, None, None)
    finally:
        ranges.remove()
    events = list(prof.events())
    step_events = [e for e in events if e.name == _STEP]
    windows = sorted((e.time_range.start, e.time_range.end) for e in step_events)
    wall = sum(b - a for a, b in windows) / 1000

    def in_step(e) -> bool:  # by time: backward work runs on autograd's own thread, outside the step's range
        return any(a <= e.time_range.start < b for a, b in windows)

    cpu = torch.autograd.DeviceType.CPU
    events = [e for e in events if in_step(e)]
    if cuda:
        submits = [e for e in events if e.device_type == cpu and e.name.startswith(_SUBMIT)]
        kernels = [  # device work; the profiler also mirrors record_function ranges onto the GPU timeline
            e
            for e in events
            if e.device_type != cpu and not getattr(e, "is_user_annotation", False) and not e.name.startswith("fastft.")
        ]
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        kernel_ms = sum(b - a for a, b in spans) / 1000
        busy = _union_ms([(max(a, lo), min(b, hi)) for a, b in spans for lo, hi in windows if a < hi and b > lo])
        busy = busy / wall if wall else 0.0
        per_stream = collections.Counter()
        for e in kernels:
            per_stream[_stream(e)] += e.time_range.end - e.time_range.start
        main = per_stream.most_common(1)[0][0] if per_stream else None
        host = [e for e in events if e.device_type == cpu and e.name not in (_STEP, _WAIT)]
        idle = _idle_sources(
            host,
            [(e.time_range.start, e.time_range.end) for e in kernels if _stream(e) == main],
            windows,
            [(e.time_range.start, e.time_range.end, e.name) for e in kernels if _stream(e) != main],
        )
    else:  # nothing is launched: count the aten calls made outside other aten calls
        submits = [
            e
            for e in events
            if e.name.startswith("aten::") and not any(p.name.startswith("aten::") for p in _ancestors(e.cpu_parent))
        ]
        kernel_ms = busy = None
        idle = collections.Counter()
    syncs = [
        e
        for e in events
        if (e.name.startswith(_SYNC) or e.name == "cudaMemcpy") and not any(p.name == _WAIT for p in _ancestors(e))
    ]
    sync_from = collections.Counter(
        next((p.name for p in _ancestors(e) if p.name.startswith("aten::")), "outside aten") for e in syncs
    )
    sources = collections.Counter(_source(e) for e in submits)
    per_layer = collections.Counter(
        next((p.name for p in _ancestors(e) if p.name.startswith(_LAYER)), None) for e in submits
    )
    layer_rows = []
    for i in range(len(layers)):
        spans = [e for e in events if e.name == f"{_LAYER}{i}"]
        host = sum(e.time_range.end - e.time_range.start for e in spans) / 1000
        kernel = sum(getattr(e, "device_time_total", 0.0) for e in spans) / 1000 if cuda else None
        layer_rows.append(
            {
                "layer": i,
                "launches": per_layer[f"{_LAYER}{i}"] / steps,
                "host_ms": host / steps,
                "kernel_ms": None if kernel is None else kernel / steps,
            }
        )
    return AuditReport(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        steps=steps,
        wall_ms=wall / steps,
        kernel_ms=None if kernel_ms is None else kernel_ms / steps,
        busy=busy,
        launches=len(submits) / steps,
        syncs=len(syncs) / steps,
        sync_sources=[(k, v / steps) for k, v in sync_from.most_common()],
        top_sources=[(k, v / steps) for k, v in sources.most_common(top)],
        idle_ms=sum(idle.values()) / steps if cuda else None,
        idle_sources=[(k, v / steps) for k, v in idle.most_common(top)],
        layers=layer_rows,
    )
