"""Multi-process e2e steps (``python -m fastft e2e --nproc N --parallel MODE``): the e2e models and
columns, each rank on its own GPU (NCCL; gloo and tiny configs on CPUs) with its own packed row (seed =
rank), timed after two warm-up steps. For each (model, mode, column) it runs 1 process and then N, and reports
tokens/s per GPU, the scaling of the total against one process, and the largest peak memory of any rank.

Modes (``--parallel``, repeatable; default ``ddp``):
- ``ddp``: ``DistributedDataParallel`` around the model (``find_unused_parameters`` for MoE models, whose
  experts do not all see tokens);
- ``fsdp2``: ``fully_shard`` on each decoder layer and the root, ``MixedPrecisionPolicy`` bf16 params (on
  GPUs) with fp32 reduction;
- ``ep`` (MoE, fastft columns): ``use_expert_parallel`` (all-to-all) and DDP for the rest;
- ``hf ep`` (MoE): transformers' own expert-parallel plan (``DistributedConfig(tp_plan="auto",
  enable_expert_parallel=True)``, the model loaded from a checkpoint this script writes); every rank runs the
  same tokens, so tokens/s per GPU counts each token once over the group.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from ..spawn import exit_spawned_worker
from .models import MODEL_CONFIGS, dtype_for, is_moe, model_config, num_experts
from .stacks import COLUMNS, build, why_not_on
from .stacks import columns as columns_here
from .stream import make_batch
from .train import step_ms

MODES = ("ddp", "fsdp2", "ep", "hf ep")
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


def _wrap(model, mode: str, moe: bool):
    import torch.distributed as dist

    from fastft.integrations import transformers as ft_hf
    from fastft.integrations.transformers import decoder_layers

    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" not in n)
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if mode == "hf ep":
        return model
    from torch.nn.parallel import DistributedDataParallel

    if mode == "ep":
        ft_hf.use_expert_parallel(model, dist.new_group(list(range(dist.get_world_size()))))
    device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
    return DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=moe and mode == "ddp")


def _worker(rank, world, init, out, name, column, mode, tiny, checkpoint, schedule):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if gpu else "cpu")
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from fastft.integrations import transformers as ft_hf

        if gpu:
            torch.cuda.reset_peak_memory_stats()
        model = None
        if mode == "hf ep":
            import transformers
            from transformers.distributed import DistributedConfig

            config = DistributedConfig(tp_plan="auto", enable_expert_parallel=True)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, dtype=dtype_for(device), distributed_config=config
            ).to(device)  # with one rank, the plan leaves the model where it was loaded
        (model, _), restore = build(name, column, device, tiny, model=model)
        moe = ft_hf.has_experts(model)
        wrapped = _wrap(model, mode, moe)
        batch, _ = make_batch(name, device, tiny, seed=0 if mode == "hf ep" else rank)
        try:
            ms, peak, loss = step_ms(wrapped, batch, schedule[1], device, warmup=schedule[0])
        finally:
            restore()
        row = torch.tensor([ms, peak, batch["input_ids"].shape[1]], dtype=torch.float64, device=device)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        if rank == 0:
            with open(out, "w") as f:
                json.dump([r.tolist() for r in rows], f)
    finally:
        dist.destroy_process_group()
    exit_spawned_worker()


def _spawn(world: int, name: str, column: str, mode: str, tiny: bool, checkpoint, schedule) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(
            _worker,
            args=(world, os.path.join(tmp, "init"), out, name, column, mode, tiny, checkpoint, schedule),
            nprocs=world,
        )
        with open(out) as f:
            rows = json.load(f)
    step = max(r[0] for r in rows)  # the group steps together: the slowest rank sets the pace
    tokens = rows[0][2] if mode == "hf ep" else sum(r[2] for r in rows)  # hf ep: the same tokens everywhere
    peak = max(r[1] for r in rows)
    return {
        "model": name,
        "column": column,
        "parallel": mode,
        "world": world,
        "step_ms": step,
        "tokens_per_s_per_gpu": tokens / step * 1000 / world,
        "peak_gib": peak / 2**30 if peak >= 0 else None,
    }


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


def run(nproc: int, quick: bool, models=None, columns=None, modes=None, warmup=None, steps=None) -> list[dict]:
    """Records of 1 and ``nproc`` processes per (model, mode, column); see the module docstring. Each rank
    trains ``warmup`` untimed steps (default 2) and ``steps`` timed ones (default 3; 2 in the tiny configs).
    ``ValueError`` where ``why_not`` says why it cannot run."""
    if why := why_not(nproc, models, columns, modes, quick):
        raise ValueError(why)
    gpu = torch.cuda.is_available()
    tiny = quick or not gpu
    schedule = (2 if warmup is None else warmup, steps or (2 if tiny else 3))
    device = torch.device("cuda" if gpu else "cpu")
    records = []
    for name in models or MODELS:
        for mode in modes or ["ddp"]:
            if mode in ("ep", "hf ep") and not is_moe(name):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = _checkpoint(name, tiny, tmp) if mode == "hf ep" else None
                for column in columns_here(device, columns or DEFAULT_COLUMNS):
                    if column == "naive glue" or (mode == "ep" and not COLUMNS[column].fastft):
                        continue
                    if why := why_not_on(column, name):
                        print(f"{name}: {column!r} skipped: {why}", flush=True)
                        continue
                    for world in sorted({1, nproc}):
                        r = _spawn(world, name, column, mode, tiny, checkpoint, schedule)
                        one = next((p for p in records if p["world"] == 1 and _same(p, r)), r)
                        r["scaling"] = r["tokens_per_s_per_gpu"] * world / one["tokens_per_s_per_gpu"]
                        r["layers"] = model_config(name, tiny).num_hidden_layers
                        records.append(r)
                        peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] is not None else "n/a"
                        print(
                            f"{name:14s} {mode:6s} {column:16s} x{world}  {r['step_ms']:9.1f} ms/step  "
                            f"{r['tokens_per_s_per_gpu']:9.0f} tok/s/GPU  scaling {r['scaling']:.2f}x  peak {peak}",
                            flush=True,
                        )
    return records


def _same(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("model", "column", "parallel"))


def format_table(records: list[dict]) -> str:
    lines = [
        "| model | layers | parallel | column | GPUs | step ms | tokens/s per GPU | scaling vs 1 | peak GiB (a rank) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['parallel']} | {r['column']} | {r['world']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} | {r['scaling']:.2f}x | {peak} |"
        )
    return "\n".join(lines)
