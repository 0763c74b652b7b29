"""The training harness of the main job: AdamW steps over a list of step inputs (``fastft.e2e.stream.step_inputs``),
each step's loss read as a logging loop does, timed to the end of its GPU work, with the graphs
``torch.compile`` compiled and the CUDA graphs ``fastft.graphs`` captured in each step; and the record of one
column's run (``record``), from a column's facts given as arguments.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .stream import micro_batches, step_inputs


@dataclasses.dataclass(frozen=True)
class Steps:
    """What ``train`` measured."""

    losses: list  # each step's loss, first steps included
    seconds: list  # each step's wall time, to the end of its GPU work
    compiles: list  # graphs torch.compile compiled during each step
    captures: list  # fastft.graphs captures during each step (one per layer and signature)
    peak_bytes: int  # peak reserved memory over the steps after ``warmup`` (graph pools included); -1 without a GPU
    prime_s: float = 0.0  # wall time of the first pass (``train_primed``) before these steps; 0 without one


def failed_steps(count: int) -> Steps:
    """The ``Steps`` of a run that trained none of its ``count`` steps: NaN losses and times."""
    nan = [float("nan")] * count
    return Steps(nan, nan, [0] * count, [0] * count, -1)


def schedule(tiny: bool, warmup: int | None = None, steps: int | None = None) -> tuple[int, int]:
    """(first steps, timed steps) of each column: the given counts, or the defaults (3 and 20; 1 and 2 in the
    tiny configs)."""
    warmup = warmup if warmup is not None else 1 if tiny else 3
    steps = steps if steps is not None else 2 if tiny else 20
    for name, value, low in (("warmup", warmup, 0), ("steps", steps, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return warmup, steps


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process (none before anything imported dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def train_step(model, opt, batch) -> torch.Tensor:
    """One optimizer step on ``batch`` (a model-input dict, or micro-batches from ``step_inputs``, their
    losses weighted and accumulated); the step's loss, detached and not read (no sync)."""
    loss = None
    for part, weight in micro_batches(batch):
        part_loss = model(**part).loss
        if weight is not None:
            part_loss = part_loss * weight
        part_loss.backward()
        loss = part_loss.detach() if loss is None else loss + part_loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


OnStep = Callable[[int, int, float, float], None]  # (step index, steps, loss, seconds) after each step


def train(
    model,
    inputs,
    warmup: int,
    device,
    lr: float = 1e-5,
    on_step: OnStep | None = None,
    before_step: Callable[[], None] | None = None,
) -> Steps:
    """One AdamW training step per item of ``inputs``: a model-input dict, or micro-batches accumulated into
    one step (``step_inputs``); the peak memory counts from step ``warmup`` on. ``on_step`` is called after
    each step; ``before_step`` before each step's clock starts (the ranks' barrier under ``--nproc``)."""
    from fastft.graphs import capture_count

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    cuda = device.type == "cuda"
    losses, seconds, compiles, captures = [], [], [], []
    for i, batch in enumerate(inputs):
        if cuda and i == warmup:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the peak reserved counts what the timed steps hold, not the first steps' cache
            torch.cuda.reset_peak_memory_stats()
        if before_step is not None:
            before_step()
        compiled, captured = compiled_graphs(), capture_count()
        start = time.perf_counter()
        losses.append(train_step(model, opt, batch).item())  # read each step, as a logging loop does
        if cuda:
            torch.cuda.synchronize()  # work on other streams (offload copies) counts in its step
        seconds.append(time.perf_counter() - start)
        compiles.append(compiled_graphs() - compiled)
        captures.append(capture_count() - captured)
        if on_step is not None:
            on_step(i, len(inputs), losses[-1], seconds[-1])
    peak = torch.cuda.max_memory_reserved() if cuda else -1  # what the process holds: CUDA graph pools included
    return Steps(losses, seconds, compiles, captures, peak)


def train_primed(model, inputs, warmup: int, device, on_step: OnStep | None = None) -> Steps:
    """``train`` on a GPU after a first pass over the same ``inputs`` at learning rate 0 (no weight changes;
    the losses, timed steps and peak are the second pass's): steady state is what a long run sees. A
    process's first pass over a padding-free stream runs every step slower (a cost per row count it has not
    seen; absent on fixed-length packs; docs/benchmarks.md), which only the first column of a run would pay.
    The first pass's wall time (``prime_s``), compiles and captures count as the first steps'. On CPU (or
    with no first steps): ``train`` alone."""
    if device.type != "cuda" or warmup < 1:
        return train(model, inputs, warmup, device, on_step=on_step)
    first = train(model, inputs, warmup, device, lr=0.0, on_step=on_step)
    second = train(model, inputs, warmup, device, on_step=on_step)
    return dataclasses.replace(
        second,
        compiles=[sum(first.compiles) + second.compiles[0], *second.compiles[1:]],
        captures=[sum(first.captures) + second.captures[0], *second.captures[1:]],
        prime_s=sum(first.seconds),
    )


def record(
    name: str,
    kind: str,
    column: str,
    batches: list,
    warmup: int,
    result: Steps,
    *,
    dtype: str,
    lora: bool,
    quant: str | None,
    layers: int,
    padded_budget: int | None = None,
    leaks: bool = False,
) -> dict:
    """The record of ``column`` on the model ``name`` and stream ``kind`` (one row of the e2e table) from what
    ``train`` measured on ``batches``. The column's facts: ``dtype`` of the model's parameters
    (``"bfloat16"``), ``lora`` on or not, ``quant`` (None or ``"nf4"``), the model's decoder ``layers``,
    ``padded_budget`` (a padded column's micro-batch tokens, ``step_inputs``; None: packed) and whether its
    rows ``leaks`` documents into each other."""
    timed = batches[warmup:]
    timed_s = sum(result.seconds[warmup:])
    tokens = [b.num_tokens for b in timed]
    fed = [sum(p["input_ids"].numel() for p, _ in micro_batches(step_inputs(b, padded_budget))) for b in timed]
    return {
        "model": name,
        "stream": kind,
        "column": column,
        "leaks": leaks,  # documents of a row see each other (fastft.e2e.stacks.leaks)
        "padded": padded_budget is not None,  # trained on the documents padded, in micro-batches
        "padding": 1 - sum(tokens) / sum(fed),  # share of the timed steps' model inputs that is padding
        "layers": layers,
        "dtype": dtype,
        "quant": quant or "none",  # "nf4": the decoder's linear layers in bitsandbytes 4-bit
        "lora": lora,
        "warmup": warmup,
        "steps": len(timed),
        "tokens_per_s": sum(tokens) / timed_s,  # real tokens over the timed steps' wall time
        "step_ms": timed_s / len(timed) * 1000,  # mean of the timed steps
        "first_steps_s": result.prime_s + sum(result.seconds[:warmup]),  # the first pass (GPU) and first steps
        # what a run of this length takes from a fresh start: the first pass where there was one, else every step
        "total_s": result.prime_s or sum(result.seconds),
        "first_step_s": result.seconds[:warmup],
        "prime_s": result.prime_s,  # wall time of the first pass over the stream (``train_primed``; 0 on CPU)
        "step_s": result.seconds[warmup:],
        "peak_gib": result.peak_bytes / 2**30 if result.peak_bytes >= 0 else None,
        "compiles_first": sum(result.compiles[:warmup]),  # graphs torch.compile compiled in the first steps
        "compiles_timed": sum(result.compiles[warmup:]),  # ... and in the timed steps
        "recompiling_steps": sum(1 for n in result.compiles[warmup:] if n),  # timed steps that compiled
        "captures_first": sum(result.captures[:warmup]),  # fastft.graphs captures in the first steps
        "captures_timed": sum(result.captures[warmup:]),  # ... and in the timed steps
        "tokens_min": min(tokens),
        "tokens_max": max(tokens),
        "documents": statistics.mean(len(b.seq_lengths) for b in timed),  # per timed row
        "losses": result.losses,  # every step's, first steps included
        "loss": result.losses[0],
    }
