"""The main job's loop (``python -m fastft e2e``): fine-tuning steps of transformers models built from configs
with random weights, LoRA (peft, when installed; else all weights train) with AdamW, gradient checkpointing
on, one column per stack (``fastft.e2e.stacks``), on a stream of fresh packed batches
(``fastft.e2e.stream``). ``fastft.e2e.report`` makes the table, the loss check and its verdict line of the
records.

The stream (``--stream``): each step a new packed row of SFT-like documents, the same rows for every column:
``fixed`` packs of exactly the model's token budget (16,384 tokens; gpt-oss 4,096; 256 in the tiny configs),
or ``padding-free`` rows of whole documents up to the budget, whose token count changes every step. The
default is ``padding-free`` (how TRL packs now, and the hard case for anything that specializes on shapes);
``both`` runs each column on both, twice the time.

Models: on a GPU every model of ``fastft.e2e.models`` at real size (fewer layers for the large ones), bf16.
On a CPU (or with ``quick``) tiny 2-layer configs (fp32 on a CPU), where step times show that each stack runs
and nothing about its speed: no speed ratios then. A CPU runs ``REPRESENTATIVE`` models (one dense, one MoE,
one hybrid) unless asked for all of them or for named ones.

Each column runs ``warmup`` first steps (default 3; 1 in the tiny configs) and then ``steps`` timed steps
(default 20; 2 in the tiny configs), every step on the next batch (``fastft.e2e.train``). On a GPU the column
first passes over the same batches at learning rate 0 (``train_primed``). Reported: steady-state tokens/s
(real tokens, no padding, over the timed steps' wall time), the mean step time, the wall time of the first
pass and first steps apart (autotune, compiles, CUDA graph captures happen there: shown, not hidden), peak
memory over the timed steps (reserved: what the process holds, CUDA graph pools included), the graphs
``torch.compile`` compiled and the CUDA graphs ``fastft.graphs`` captured, in the first steps and in the timed
steps, and every step's loss. ``torch.compile``'s in-process caches are reset before each column, so each
compiles for itself. Each fastft column's ``vs fastest peer`` is its tokens/s over the highest tokens/s among
the peer columns (``stock *``, ``liger + stock flex``, ``unsloth``) that do not leak, on the same model and
stream (``LEGEND``).
"""

from __future__ import annotations

import gc
import sys

import torch

from . import quant as quantization
from . import unsloth
from .floor import with_floor
from .models import MODEL_CONFIGS as MODELS
from .models import has_mixers, is_moe
from .report import captured, compiled
from .stacks import COLUMNS, build, column_inputs, columns, installed, record_facts, why_not, why_not_on
from .stream import stream_batches, streams_of
from .train import failed_steps, record, schedule, train_primed

REPRESENTATIVE = ("Qwen3-0.6B", "Qwen3-30B-A3B", "Qwen3.5")  # a CPU's default: dense, MoE, hybrid
SLOW_STEP_S = 10.0  # a step slower than this prints a progress line as the column runs


def tiny_configs(device: torch.device, quick: bool) -> bool:
    """Whether the run builds the tiny configs: on a CPU always, on a GPU with ``quick``."""
    return device.type != "cuda" or quick


def speed_ratios(device: torch.device, quick: bool) -> bool:
    """Whether the run's speed ratios mean something: at real sizes only (a GPU without ``quick``)."""
    return not tiny_configs(device, quick)


def models_of(device: torch.device, models=None, everything: bool = False) -> list[str]:
    """The models a run trains: ``models`` if given, else all (on a GPU, or with ``everything``), else the
    ``REPRESENTATIVE`` ones."""
    if models:
        return list(models)
    return list(MODELS) if everything or device.type == "cuda" else list(REPRESENTATIVE)


def kind_of(name: str) -> str:
    """The model ``name`` in a word: dense, MoE, hybrid or hybrid MoE."""
    kind = "hybrid" if has_mixers(name) else ""
    return f"{kind} MoE".strip() if is_moe(name) else kind or "dense"


def fastft_backend(device: torch.device) -> str:
    """What fastft's columns run on ``device``, in words."""
    from fastft import capabilities, dispatch

    choice = dispatch.requested_backend()
    if choice == "torch" or (device.type != "cuda" and not capabilities.interpreting()):
        return "fastft's torch paths"
    if device.type != "cuda":
        return "fastft's Triton kernels in Triton's interpreter (slow by design: minutes per column)"
    return "fastft's Triton kernels" + (" (FASTFT_BACKEND=triton)" if choice == "triton" else "")


def describe(
    device: torch.device,
    quick: bool,
    only=None,
    stream=None,
    warmup=None,
    steps=None,
    quant=None,
    models=None,
    layers=None,
) -> str:
    """What the run measures, said before it starts; the columns that cannot run here, one line each.
    ``models``: the models it trains (``models_of``); ``layers``: as ``run``'s."""
    tiny = tiny_configs(device, quick)
    warmup, steps = schedule(tiny, warmup, steps)
    lines = []
    if tiny:
        lines.append(
            f"e2e on {device.type}: tiny 2-layer configs of each model, rows of up to 256 tokens, "
            f"{'bf16' if device.type == 'cuda' else 'fp32'}, {fastft_backend(device)}"
        )
        where = "on a CPU (a GPU runs the real sizes)" if device.type != "cuda" else "with --quick's tiny configs"
        lines.append(f"the step times show that each stack runs, not how fast it is: no speed ratios {where}")
    else:
        depth = "fewer layers for the large ones" if layers is None else f"--layers {layers}"
        lines.append(
            f"e2e on the GPU: real-size configs ({depth}), bf16, rows of up to 16,384 "
            f"tokens (gpt-oss 4,096), {fastft_backend(device)}"
        )
    if models is not None:
        named = ", ".join(f"{n} ({kind_of(n)})" for n in models)
        rest = len(MODELS) - len(models)
        lines.append(f"models: {named}" + (f"; {rest} more with --all, or name them with --model" if rest else ""))
    lines.append(
        f"stream: a fresh packed row each step, the same for every column ({', '.join(streams_of(stream))}); "
        f"per column {warmup} first steps (shown apart: compiles, autotune, graph captures), then {steps} timed steps"
    )
    if installed("peft"):
        lines.append("LoRA r=16 on the attention (and dense MLP, and linear-attention) projections through peft, AdamW")
    else:
        lines.append("peft is not installed: all weights train (pip install peft for the LoRA columns)")
    if quant_line := quantization.describe(quant):
        lines.append(quant_line)
    skipped = [(c, why_not(c, device)) for c in COLUMNS if (not only or c in only) and why_not(c, device)]
    if skipped:
        lines.append("skipped here:")
        lines += [f"  '{c}': {why}" for c, why in skipped]
    lines.append(
        "each column starts from the same weights and stream: fastft's losses must equal those of the first of "
        "naive glue, stock sdpa, stock sdpa padded that keeps documents apart, at every step (exit status 1 if not)"
    )
    return "\n".join("  " + line for line in lines)


def _reset_compiles() -> None:
    """Empty torch.compile's caches, so a column pays its own compiles (not loaded before: nothing to reset)."""
    if "torch._dynamo" in sys.modules:
        torch.compiler.reset()


def run(
    device: torch.device,
    quick: bool,
    models=None,
    only_columns=None,
    stream=None,
    warmup=None,
    steps=None,
    quant=None,
    layers=None,
) -> list[dict]:
    """One record per (model, stream, column); see the module docstring and ``format_table``. ``models``: the
    models to train (default ``models_of(device)``); ``stream``: a ``STREAM_CHOICES`` entry (default
    ``padding-free``); ``warmup``, ``steps``: see ``schedule``; ``quant``: ``"nf4"``, each column on the model
    in bitsandbytes 4-bit (``fastft.e2e.quant``); ``layers``: the decoder layers each model keeps at real size
    (an int or ``"all"``, ``fastft.e2e.models.layers_arg``; default the table's)."""
    tiny = tiny_configs(device, quick)
    warmup, steps = schedule(tiny, warmup, steps)
    quant = quantization.quant_arg(quant)
    kinds = streams_of(stream)
    if layers is not None and tiny:
        raise ValueError(f"layers is taken at real size only (a GPU without quick), got {layers!r}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the end-to-end benchmark needs transformers (pip install transformers)")
        return []
    records, threads = [], torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the tiny configs' matrices: more threads only wait for each other
    try:
        for name in models_of(device, models):
            for kind in kinds:
                batches = stream_batches(name, kind, tiny, warmup + steps, device)
                for column in columns(device, only_columns):
                    if why_not_on(column, name):
                        continue
                    gc.collect()  # every column starts from a collected heap, the first one too
                    records.append(_run_column(name, kind, column, device, tiny, batches, warmup, quant, layers))
                    _print(records[-1])
                    gc.collect()  # hooks and bound methods (fastft's, Liger's, PEFT's) make cycles: free them now
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(threads)
    return records


def _progress(name: str, kind: str, column: str):
    def on_step(i: int, total: int, loss: float, seconds: float) -> None:
        if seconds > SLOW_STEP_S:
            print(
                f"{name:14s} {kind:12s} {column:22s} step {i + 1}/{total}: {seconds:.0f} s, loss {loss:.5f}", flush=True
            )

    return on_step


def _run_column(
    name: str, kind: str, column: str, device, tiny: bool, batches: list, warmup: int, quant=None, layers=None
) -> dict:
    if COLUMNS[column].own_process:  # unsloth: a process of its own builds and trains, same stream
        quantization.forget_saved()  # its process saves a copy of its own: one model on disk at a time
        row = unsloth.run_column(name, kind, column, device, tiny, batches, warmup, quant=quant, layers=layers)
        return with_floor(row, name, batches, warmup, device, tiny, layers)
    _reset_compiles()
    (model, lora), restore = build(name, column, device, tiny, quant=quant, layers=layers)
    dtype = str(next(model.parameters()).dtype).split(".")[-1]
    error, plan = None, None
    try:
        inputs = [column_inputs(column, b, name, tiny) for b in batches]
        result = train_primed(model, inputs, warmup, device, on_step=_progress(name, kind, column))
        plan = _memory_plan(model) if COLUMNS[column].fastft else None
    except torch.OutOfMemoryError:
        result, error = failed_steps(len(batches)), "out of memory"
    except Exception as e:  # a peer's own failure (e.g. flash-linear-attention refusing Hopper) is its row's result
        if COLUMNS[column].fastft:
            raise
        result, error = failed_steps(len(batches)), f"{type(e).__name__}: {e}"
    finally:
        restore()
        del model
    facts = record_facts(column, name, tiny, layers)
    row = record(name, kind, column, batches, warmup, result, dtype=dtype, lora=lora, quant=quant, **facts)
    row = with_floor(row, name, batches, warmup, device, tiny, layers)
    if plan is not None:
        print(f"{name} {kind} '{column}':\n{plan}", flush=True)
        row["memory_plan"] = {"counts": plan.counts(), "budget_gib": plan.budget / 2**30, "table": str(plan)}
    return row if error is None else {**row, "error": error}


def _memory_plan(model):
    """The memory plan in force on a fastft column's model (None without one)."""
    from fastft.integrations.transformers import memory_plan

    return memory_plan(model)


def _print(r: dict) -> None:
    memory = f"  peak {r['peak_gib']:6.2f} GiB" if r["peak_gib"] is not None else ""
    compiles = f"  torch.compile {r['compiles_first']} + {r['compiles_timed']}" if compiled(r) else ""
    if captured(r):
        compiles += f"  graph captures {r['captures_first']} + {r['captures_timed']}"
    leak = "  (leaks across documents)" if r.get("leaks") else ""
    if r.get("error"):
        print(f"{r['model']:14s} {r['stream']:12s} {r['column'] + leak:22s} failed: {r['error']}", flush=True)
        return
    print(
        f"{r['model']:14s} {r['stream']:12s} {r['column'] + leak:22s} {r['tokens_per_s']:9.0f} tok/s "
        f"{r['step_ms']:9.1f} ms/step  first {r['warmup']} steps {r['first_steps_s']:7.1f} s{memory}{compiles}  "
        f"loss {r['loss']:.5f}",
        flush=True,
    )
