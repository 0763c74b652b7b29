"""Multi-process e2e steps (``python -m fastft e2e --nproc N --parallel MODE``) on the padding-free stream: each
rank on its own GPU (NCCL; gloo and tiny configs on CPUs), a fresh share of the seeded stream every step.

Each step the group trains a global batch: the next N rows of the model's padding-free stream
(``fastft.e2e.stream.model_stream``, seed 0), shared out two ways, both run on the same documents:

- ``rows``: rank r trains row r, as a distributed sampler with a flattening collator gives: each rank packs its
  own row, so token counts (and attention's quadratic cost) differ per rank every step;
- ``balanced``: the N rows' documents split over the N ranks by ``fastft.balance_documents`` (cost: tokens plus
  attention's term, ``attention_tokens`` = 12 x the hidden size), each rank's documents packed into one row.

One GPU trains every share of every step alone: the plain model (no wrapper, no process group), one optimizer
step per share. Its times are the base of the scaling (the same documents on one GPU) and each rank's own work;
a rank's wait is the group's step (which the slowest rank sets) minus its work: waiting for the others, plus
communication. ``imbalance``: the slowest rank's work over the mean rank's, minus 1, averaged over steps.

Every run (one GPU or N) passes once over its steps at learning rate 0 (a process's first pass over new row
counts is slower; the single-process job primes the same way), then trains ``warmup`` untimed and ``steps``
timed steps; the ranks start each step together (a barrier, outside the timing) and a step ends with its GPU
work. Peak memory is each process's peak reserved memory over the timed steps.

Modes (``--parallel``, repeatable; default ``ddp``):
- ``ddp``: ``DistributedDataParallel`` around the model (``find_unused_parameters`` for MoE models, whose
  experts do not all see tokens);
- ``fsdp2``: ``fully_shard`` on each decoder layer and the root, as users write it: every parameter sharded,
  FSDP2's defaults, ``MixedPrecisionPolicy`` model-dtype params with fp32 reduction;
- ``shard``: ``fastft.integrations.fsdp.shard`` (LoRA: the frozen base whole on every rank, the adapters
  sharded), the same precision policy;
- ``ep`` (MoE, fastft columns): ``use_expert_parallel`` (all-to-all) and DDP for the rest; also run with one
  process over every share, against the plain model. A rank's work is still the plain model on its share, so
  its wait also holds what expert parallelism adds: the all-to-alls, their host syncs and the experts' uneven
  load over ranks;
- ``hf ep`` (MoE): transformers' own expert-parallel plan (``DistributedConfig(tp_plan="auto",
  enable_expert_parallel=True)``, the model loaded from a checkpoint this module writes); every rank runs the
  same tokens (rank 0's share of ``rows``), so tokens/s per GPU counts each token once over the group (no work,
  wait or imbalance per rank; the one-GPU base is rank 0's shares alone).

Records of one process (``ep``, or ``--nproc 1``) have no work, wait or imbalance per rank either.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile

import torch

from ..spawn import exit_spawned_worker
from .models import MODEL_CONFIGS, dtype_for, is_moe, model_config, num_experts
from .stacks import COLUMNS, build, why_not_on
from .stacks import columns as columns_here
from .stream import regroup, stream_batches
from .train import schedule, train

MODES = ("ddp", "fsdp2", "shard", "ep", "hf ep")
SPLITS = ("rows", "balanced")
MODELS = ("Qwen3-0.6B", "Qwen3-30B-A3B")  # run without --model: a dense model and a MoE one
DEFAULT_COLUMNS = ("stock sdpa", "fastft")


def why_not(nproc: int, models, columns=None, modes=None, quick: bool = False) -> str | None:
    """Why ``run(nproc, quick, models, columns, modes)`` cannot run here or would run nothing, in words for a
    usage error, or None. Checked before spawning: a worker would fail a minute in."""
    gpu = torch.cuda.is_available()
    if gpu and torch.cuda.device_count() < nproc:
        return f"--nproc {nproc} needs {nproc} GPUs, this machine has {torch.cuda.device_count()}"
    tiny = quick or not gpu
    models, modes = models or MODELS, modes or ["ddp"]
    for mode in set(modes) & {"ep", "hf ep"}:
        moe = [name for name in models if is_moe(name)]
        if not moe:
            return f"--parallel {mode} needs a MoE --model ({', '.join(n for n in MODEL_CONFIGS if is_moe(n))})"
        for name in moe:
            experts = num_experts(name, tiny)
            if experts % nproc:
                return (
                    f"--parallel {mode} gives each rank an equal share of {name}'s {experts} experts"
                    f"{' (tiny config)' if tiny else ''}: {experts} experts do not split over --nproc {nproc}"
                )
    if "ep" in modes and not any(COLUMNS[c].fastft for c in columns or DEFAULT_COLUMNS):
        return "--parallel ep is fastft's expert parallelism: it needs a fastft --column"
    for c in columns or ():
        if COLUMNS[c].padded or COLUMNS[c].own_process:
            kind = "trains on padded rows" if COLUMNS[c].padded else "runs in a process of its own"
            return f"--column {c!r} does not run under --nproc: it {kind}, the ranks train on packed rows"
    return None


def shares(name: str, tiny: bool, world: int, count: int, split: str) -> list[list]:
    """``count`` global steps of the model's padding-free stream (seed 0) as ``PackedBatch`` rows, ``[step][rank]``
    for ``world`` ranks, shared out as ``split`` says (see the module docstring)."""
    from fastft import balance_documents

    rows = stream_batches(name, "padding-free", tiny, count * world)
    steps = [rows[i * world : (i + 1) * world] for i in range(count)]
    if split == "rows":
        return steps
    if split != "balanced":
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    attention_tokens = 12 * model_config(name, tiny).hidden_size
    out = []
    for step in steps:
        lengths = [n for row in step for n in row.seq_lengths]
        plan = balance_documents(lengths, world, attention_tokens=attention_tokens)
        out.append(regroup(step, [rank[0] for rank in plan.documents]))
    return out


def _wrap(model, mode: str | None, moe: bool):
    import torch.distributed as dist

    from fastft.integrations import transformers as ft_hf
    from fastft.integrations.transformers import decoder_layers

    if mode is None or mode == "hf ep":
        return model
    if mode in ("fsdp2", "shard"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from fastft.integrations.fsdp import shard

        dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        if mode == "shard":
            return shard(model, mp_policy=policy)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    from torch.nn.parallel import DistributedDataParallel

    if mode == "ep":
        ft_hf.use_expert_parallel(model, dist.new_group(list(range(dist.get_world_size()))))
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=moe and mode == "ddp")


def _barrier(device) -> None:
    """The ranks start a step together: a barrier, and this GPU's work done."""
    import torch.distributed as dist

    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
        torch.cuda.synchronize(device)
    else:
        dist.barrier()


def _worker(rank, world, init, out, job):
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    group = job["mode"] is not None
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    if group:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from fastft.integrations import transformers as ft_hf

        name, tiny, mode = job["name"], job["tiny"], job["mode"]
        model = None
        if mode == "hf ep":
            import transformers
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                job["checkpoint"], dtype=dtype_for(device), distributed_config=config
            ).to(device)  # with one rank, the plan leaves the model where it was loaded
        (model, _), restore = build(name, job["column"], device, tiny, model=model)
        try:
            wrapped = _wrap(model, mode, ft_hf.has_experts(model))
            result = {}
            for split in job["splits"]:
                steps = shares(name, tiny, job["parts"], job["warmup"] + job["steps"], split)
                if world == 1:  # every share of each step, one after another
                    items, warmup = [s for step in steps for s in step], job["warmup"] * job["parts"]
                else:
                    items, warmup = [step[0 if mode == "hf ep" else rank] for step in steps], job["warmup"]
                inputs = [b.to(device).inputs() for b in items]
                together = functools.partial(_barrier, device) if group else None
                prime = train(wrapped, inputs, warmup, device, lr=0.0, before_step=together)
                timed = train(wrapped, inputs, warmup, device, before_step=together)
                result[split] = {
                    "prime_s": sum(prime.seconds),
                    "first_s": timed.seconds[:warmup],
                    "step_s": timed.seconds[warmup:],
                    "tokens": [b.num_tokens for b in items[warmup:]],
                    "peak": timed.peak_bytes,
                }
        finally:
            restore()
        with open(f"{out}.{rank}", "w") as f:
            json.dump(result, f)
    finally:
        if group:
            dist.destroy_process_group()
    exit_spawned_worker()


def _spawn(world: int, job: dict) -> list[dict]:
    """Each rank's results of ``job`` run by ``world`` processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), out, job), nprocs=world)
        results = []
        for rank in range(world):
            with open(f"{out}.{rank}") as f:
                results.append(json.load(f))
    return results


def _checkpoint(name: str, tiny: bool, path: str) -> str:
    """transformers' expert-parallel plan loads its shards from a checkpoint: the e2e model's fixed-seed
    weights, written once."""
    import transformers

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            model_config(name, tiny), dtype=dtype_for(torch.device(device))
        )
    model.save_pretrained(path)
    del model
    return path


def _record(job, world, split, ranks, base) -> dict:
    """The record of ``job`` on ``world`` processes and ``split`` from each rank's results (``ranks``) and the
    plain model's on one GPU (``base``, every share of each step in rank order). Per-rank work, wait and
    imbalance where ranks train shares of their own (several processes, not ``hf ep``); None otherwise."""
    parts, steps, hf = job["parts"], job["steps"], job["mode"] == "hf ep"
    own = [r[split] for r in ranks]
    alone = base[0][split]["step_s"]
    work = [alone[i * parts : (i + 1) * parts] for i in range(steps)]  # [step][rank]: each share alone
    if world == 1:  # every share of each step, one after another: a global step on one GPU
        step_s = [sum(own[0]["step_s"][i * parts : (i + 1) * parts]) for i in range(steps)]
    else:  # the group steps at the slowest rank's pace
        step_s = [max(r["step_s"][i] for r in own) for i in range(steps)]
    if hf:  # every rank runs rank 0's share: the same tokens once, on one GPU rank 0's shares alone
        tokens, one_gpu = sum(own[0]["tokens"]), sum(w[0] for w in work)
    else:
        tokens, one_gpu = sum(sum(r["tokens"]) for r in own), sum(alone)
    shared = world > 1 and not hf  # ranks of their own shares
    tokens_per_rank = [[r["tokens"][i] for r in own] for i in range(steps)]
    return {
        "model": job["name"],
        "layers": model_config(job["name"], job["tiny"]).num_hidden_layers,
        "column": job["column"],
        "parallel": job["mode"],
        "split": split,
        "world": world,
        "warmup": job["warmup"],
        "steps": steps,
        "step_ms": statistics.mean(step_s) * 1000,
        "tokens_per_s_per_gpu": tokens / sum(step_s) / world,
        "one_gpu_tokens_per_s": tokens / one_gpu,
        "scaling": one_gpu / sum(step_s),
        "rank_step_ms": [statistics.mean(r["step_s"]) * 1000 for r in own],  # each process's own mean step
        "work_ms": [statistics.mean(w[r] for w in work) * 1000 for r in range(world)] if shared else None,
        "wait_ms": [statistics.mean(step_s[i] - work[i][r] for i in range(steps)) * 1000 for r in range(world)]
        if shared
        else None,
        "imbalance": statistics.mean(max(w) / statistics.mean(w) - 1 for w in work) if shared else None,
        "token_imbalance": statistics.mean(max(t) / statistics.mean(t) - 1 for t in tokens_per_rank)
        if shared
        else None,
        "first_steps_s": max(r["prime_s"] + sum(r["first_s"]) for r in own),
        "peak_gib": max(r["peak"] for r in own) / 2**30 if own[0]["peak"] >= 0 else None,
        "one_gpu_peak_gib": base[0][split]["peak"] / 2**30 if base[0][split]["peak"] >= 0 else None,
    }


def run(nproc: int, quick: bool, models=None, columns=None, modes=None, warmup=None, steps=None) -> list[dict]:
    """Records per (model, column, mode, split) of ``nproc`` processes (and of one process for ``ep``) against
    the plain model on one GPU; see the module docstring. ``warmup``/``steps``: ``fastft.e2e.train.schedule``'s
    (3 and 20; 1 and 2 in the tiny configs). ``ValueError`` where ``why_not`` says why it cannot run."""
    if why := why_not(nproc, models, columns, modes, quick):
        raise ValueError(why)
    gpu = torch.cuda.is_available()
    tiny = quick or not gpu
    warmup, steps = schedule(tiny, warmup, steps)
    device = torch.device("cuda" if gpu else "cpu")
    records = []
    for name in models or MODELS:
        todo = [m for m in modes or ["ddp"] if is_moe(name) or m not in ("ep", "hf ep")]
        if not todo:
            continue
        for column in columns_here(device, columns or DEFAULT_COLUMNS):
            if column == "naive glue":
                continue
            if why := why_not_on(column, name):
                print(f"{name}: {column!r} skipped: {why}", flush=True)
                continue
            runs = [m for m in todo if m != "ep" or COLUMNS[column].fastft]
            if not runs:
                continue
            needed = tuple(s for s in SPLITS if any(m != "hf ep" or s == "rows" for m in runs))
            job = dict(name=name, column=column, tiny=tiny, parts=nproc, warmup=warmup, steps=steps)
            base = _spawn(1, dict(job, mode=None, checkpoint=None, splits=needed))
            for mode in runs:
                with tempfile.TemporaryDirectory() as tmp:
                    checkpoint = _checkpoint(name, tiny, tmp) if mode == "hf ep" else None
                    splits = ("rows",) if mode == "hf ep" else SPLITS
                    mode_job = dict(job, mode=mode, checkpoint=checkpoint, splits=splits)
                    for world in sorted({nproc, 1 if mode == "ep" else nproc}):
                        ranks = _spawn(world, mode_job)
                        for split in splits:
                            r = _record(mode_job, world, split, ranks, base)
                            records.append(r)
                            print(_line(r), flush=True)
    return records


def _line(r: dict) -> str:
    peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "n/a"
    return (
        f"{r['model']:14s} {r['parallel']:6s} {r['column']:16s} {r['split']:8s} x{r['world']}  "
        f"{r['step_ms']:9.1f} ms/step  {r['tokens_per_s_per_gpu']:9.0f} tok/s/GPU  scaling {r['scaling']:.2f}x"
        + (f"  slowest rank +{r['imbalance']:.1%}" if r["imbalance"] is not None else "")
        + f"  peak {peak}"
    )


def format_table(records: list[dict]) -> str:
    """The records as a markdown table: one row per (model, mode, column, split, processes)."""
    lines = [
        "| model | layers | parallel | column | split | GPUs | step ms | tokens/s per GPU | scaling vs 1 GPU | "
        "work ms per rank | wait ms per rank | slowest rank vs mean | peak GiB per GPU (1 GPU) | first s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        peak = f"{r['peak_gib']:.2f} ({r['one_gpu_peak_gib']:.2f})" if r["peak_gib"] is not None else "n/a"
        shared = r["work_ms"] is not None  # ranks of their own shares
        work = " / ".join(f"{w:.1f}" for w in r["work_ms"]) if shared else "-"
        wait = " / ".join(f"{w:.1f}" for w in r["wait_ms"]) if shared else "-"
        slowest = f"+{r['imbalance']:.1%}" if shared else "-"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['parallel']} | {r['column']} | {r['split']} | {r['world']} | "
            f"{r['step_ms']:.1f} | {r['tokens_per_s_per_gpu']:.0f} | {r['scaling']:.2f}x | {work} | {wait} | "
            f"{slowest} | {peak} | {r['first_steps_s']:.1f} |"
        )
    return "\n".join(lines)
