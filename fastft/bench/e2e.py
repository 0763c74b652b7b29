"""End-to-end fine-tuning steps on a stream of fresh packed batches (``python -m fastft bench --e2e``):
transformers models built from configs with random weights, LoRA (peft, when installed; else all weights
train) with AdamW, bf16, gradient checkpointing on.

The stream (``fastft.bench.stream``; ``--stream``): each step a new packed row of SFT-like documents, the
same rows for every column: ``fixed`` packs of exactly the model's token budget (16,384 tokens; gpt-oss
4,096; 256 in the tiny configs), or ``padding-free`` rows of whole documents up to the budget, whose token
count changes every step. The default is ``padding-free`` (how TRL packs now, and the hard case for
anything that specializes on shapes); ``both`` runs each column on both, twice the time.

Each column runs ``warmup`` first steps (default 3; 1 in the tiny configs) and then ``steps`` timed steps
(default 20; 2 in the tiny configs), every step on the next batch, its loss read as a logging loop does. On a
GPU the column first passes over the same batches at learning rate 0 (``train_primed``: a process's first
pass over new row counts runs slower, which only a run's first column paid before). Reported: steady-state
tokens/s (real tokens, no padding, over the timed steps' wall time), the mean step time, the wall time of the
first pass and first steps apart (autotune, compiles, CUDA graph captures happen there: shown, not
hidden), peak memory over the timed steps (reserved: what the process holds, CUDA graph pools included), the
graphs ``torch.compile`` compiled and the CUDA graphs ``fastft.graphs`` captured, each in the first pass and
steps and in the timed steps (a stack that recompiles or captures per batch shape shows it in the
second), and every step's loss.

The columns (``fastft.bench.columns``, whose names are re-exported here): naive glue, the stock
transformers stacks, Liger-Kernel + stock flex, and fastft's stacks; one model build each, the same weights
and stream. ``torch.compile``'s in-process caches are reset before each column, so each compiles for itself
(inductor's on-disk cache stays, as it does for a user's second run). Each fastft column's ``vs fastest
peer`` is its tokens/s over the highest tokens/s among the peer columns (users' stacks without fastft:
``stock *``, ``liger + stock flex``) on the same model and stream (``LEGEND``).

The padded columns (``stock sdpa, padded``) train on the same documents one per row, right-padded, in
micro-batches of at most the token budget (padding included), whose losses, each weighted by its share of the
step's predicted tokens, sum to the packed row's loss: one optimizer step per batch of the stream. A column
that lets documents see each other on a model (``leaks``: stock packing on Qwen3.5, whose Gated DeltaNet
layers carry state across documents; stock gpt-oss) is marked so in the table and the JSON (``leaks``).

QLoRA (``quant="nf4"``, ``--quant nf4``; ``fastft.bench.quant``): every column on the same model with its
decoder's linear layers in bitsandbytes 4-bit NF4, loaded through transformers' ``BitsAndBytesConfig``;
each record says its ``quant``.

The loss check (``loss_check``): at every step, each column's loss against the first of naive glue, stock
sdpa and stock sdpa, padded that ran and does not leak; a fastft column outside the tolerance fails the run.
``step_ms`` times one batch repeated instead of a stream (the distributed benchmark's measure).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import statistics
import sys
import time

import torch

from . import quant as quantization
from .columns import COLUMNS as COLUMNS
from .columns import build as build
from .columns import columns as columns
from .columns import dtype_for as dtype_for
from .columns import installed, leaks, why_not, why_not_on
from .columns import model_config as model_config
from .models import MODEL_CONFIGS as MODELS
from .stream import KINDS, PackedBatch, packed_stream, padded

TOKENS = {"gpt-oss-20b": 4096}  # token budget per row; 16,384 for the others
DEFAULT_STREAMS = ("padding-free",)
STREAM_CHOICES = (*KINDS, "both")  # --stream


def streams_of(choice: str | None) -> tuple[str, ...]:
    """The stream kinds a ``--stream`` choice runs (None: the default)."""
    if choice is None:
        return DEFAULT_STREAMS
    if choice not in STREAM_CHOICES:
        raise ValueError(f"stream must be one of {', '.join(map(repr, STREAM_CHOICES))}, got {choice!r}")
    return KINDS if choice == "both" else (choice,)


def schedule(tiny: bool, warmup: int | None = None, steps: int | None = None) -> tuple[int, int]:
    """(first steps, timed steps) of each column: the given counts, or the defaults (3 and 20; 1 and 2 in the
    tiny configs)."""
    warmup = warmup if warmup is not None else 1 if tiny else 3
    steps = steps if steps is not None else 2 if tiny else 20
    for name, value, low in (("warmup", warmup, 0), ("steps", steps, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return warmup, steps


def describe(device: torch.device, quick: bool, only=None, stream=None, warmup=None, steps=None, quant=None) -> str:
    """What the run measures, said before it starts; the columns that cannot run here, one line each.
    ``quant``: ``"nf4"``, every column on the 4-bit model of ``fastft.bench.quant``."""
    tiny = device.type != "cuda" or quick
    warmup, steps = schedule(tiny, warmup, steps)
    lines = []
    if tiny:
        lines.append(
            f"e2e on {device.type}: tiny 2-layer configs of each model, rows of up to 256 tokens, "
            f"{'bf16' if device.type == 'cuda' else 'fp32'}; the step times show that each stack runs, not how "
            "fast it is (tiny CPU steps vary by an order of magnitude between identical runs)"
        )
    else:
        lines.append(
            "e2e on the GPU: real-size configs (fewer layers for the large ones), bf16, rows of up to 16,384 "
            "tokens (gpt-oss 4,096)"
        )
    lines.append(
        f"stream: a fresh packed row each step, the same for every column ({', '.join(streams_of(stream))}; "
        f"fastft/bench/stream.py); per column {warmup} first steps (shown apart: compiles, autotune, graph "
        f"captures), then {steps} timed steps"
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
    if device.type != "cuda":
        lines.append("no peak memory without a GPU")
        if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("FASTFT_BACKEND", "auto") != "torch":
            lines.append(
                "fastft columns run its Triton kernels in Triton's interpreter, slowly by design "
                "(FASTFT_BACKEND=torch runs its torch path)"
            )
    lines.append(
        "each column starts from the same weights and stream: fastft's losses must equal those of the first of "
        "naive glue, stock sdpa, stock sdpa padded that keeps documents apart, at every step (exit status 1 if not)"
    )
    return "\n".join("  " + line for line in lines)


def budget(name: str, tiny: bool) -> int:
    """Tokens per packed row (and per padded micro-batch) of the model ``name``: 16,384 (gpt-oss 4,096; tiny
    configs 256)."""
    return 256 if tiny else TOKENS.get(name, 16384)


def model_stream(name: str, kind: str, tiny: bool, device=None, seed: int = 0):
    """The endless stream of ``kind`` of the model ``name`` (``fastft.bench.stream.packed_stream``): rows of
    ``budget`` tokens at most, documents around 380 tokens (tiny: 40)."""
    vocab = 256 if tiny else 128000
    return packed_stream(kind, budget(name, tiny), seed, median=40 if tiny else 380, vocab=vocab, device=device)


def step_inputs(column: str, batch: PackedBatch, name: str, tiny: bool, host_lengths: bool = False):
    """What ``column`` feeds the model for one step on ``batch``: the packed row's model inputs (a dict;
    ``host_lengths``: with the boundaries on the host, ``PackedBatch.inputs``), or for a padded column its
    micro-batches as ``[(model inputs, loss weight), ...]``, each weight its share of the step's predicted
    tokens (host ints: no sync), so that the weighted losses sum to the packed loss."""
    if not COLUMNS[column].padded:
        return batch.inputs(host_lengths)
    parts = padded(batch, budget(name, tiny))
    total = sum(p.targets for p in parts)
    return [(p.inputs(), p.targets / total) for p in parts]


def micro_batches(step) -> list:
    """``[(model inputs, loss weight or None), ...]`` of a step as ``step_inputs`` gives it."""
    return [(step, None)] if isinstance(step, dict) else list(step)


def stream_batches(name: str, kind: str, tiny: bool, count: int, device=None, seed: int = 0) -> list[PackedBatch]:
    """The first ``count`` batches of ``model_stream``."""
    return list(itertools.islice(model_stream(name, kind, tiny, device, seed), count))


def make_batch(name: str, device, tiny: bool, seed: int = 0) -> tuple[dict, list[int]]:
    """The model's first fixed-length batch of stream ``seed`` as model inputs, and its document lengths."""
    (batch,) = stream_batches(name, "fixed", tiny, 1, device, seed)
    return batch.inputs(), list(batch.seq_lengths)


@dataclasses.dataclass(frozen=True)
class Steps:
    """What ``train`` measured."""

    losses: list  # each step's loss, first steps included
    seconds: list  # each step's wall time, to the end of its GPU work
    compiles: list  # graphs torch.compile compiled during each step
    captures: list  # fastft.graphs captures during each step (one per layer and signature)
    peak_bytes: int  # peak reserved memory over the steps after ``warmup`` (graph pools included); -1 without a GPU
    prime_s: float = 0.0  # wall time of the first pass (``train_primed``) before these steps; 0 without one


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


def train(model, inputs, warmup: int, device, lr: float = 1e-5) -> Steps:
    """One AdamW training step per item of ``inputs``: a model-input dict, or micro-batches accumulated into
    one step (``step_inputs``); the peak memory counts from step ``warmup`` on."""
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
        compiled, captured = compiled_graphs(), capture_count()
        start = time.perf_counter()
        losses.append(train_step(model, opt, batch).item())  # read each step, as a logging loop does
        if cuda:
            torch.cuda.synchronize()  # work on other streams (offload copies) counts in its step
        seconds.append(time.perf_counter() - start)
        compiles.append(compiled_graphs() - compiled)
        captures.append(capture_count() - captured)
    peak = torch.cuda.max_memory_reserved() if cuda else -1  # what the process holds: CUDA graph pools included
    return Steps(losses, seconds, compiles, captures, peak)


def train_primed(model, inputs, warmup: int, device) -> Steps:
    """``train`` on a GPU after a first pass over the same ``inputs`` at learning rate 0 (no weight changes;
    the losses, timed steps and peak are the second pass's): steady state is what a long run sees. A
    process's first pass over a padding-free stream ran every step slower (gpt-oss-20b, H100: 121 vs 77 ms a
    step; not GPU clocks, module loading or the allocator; absent on fixed-length packs: a cost per row count
    it has not seen, docs/benchmarks.md 2026-11-25), and only the first column of a run paid it. The first
    pass's wall time (``prime_s``), compiles and captures count as the first steps'. On CPU (or with no first
    steps): ``train`` alone."""
    if device.type != "cuda" or warmup < 1:
        return train(model, inputs, warmup, device)
    first = train(model, inputs, warmup, device, lr=0.0)
    second = train(model, inputs, warmup, device)
    return dataclasses.replace(
        second,
        compiles=[sum(first.compiles) + second.compiles[0], *second.compiles[1:]],
        captures=[sum(first.captures) + second.captures[0], *second.captures[1:]],
        prime_s=sum(first.seconds),
    )


def step_ms(model, batch, steps: int, device) -> tuple[float, int, float]:
    """The same ``batch`` two untimed and ``steps`` timed times: (median step ms, peak bytes (CUDA graph
    pools included), first step's loss)."""
    result = train(model, [batch] * (steps + 2), 2, device)
    return statistics.median(result.seconds[2:]) * 1000, result.peak_bytes, result.losses[0]


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
) -> list[dict]:
    """One record per (model, stream, column); see the module docstring and ``format_table``. ``stream``: a
    ``STREAM_CHOICES`` entry (default ``padding-free``); ``warmup``, ``steps``: see ``schedule``; ``quant``:
    ``"nf4"``, each column on the model in bitsandbytes 4-bit (``fastft.bench.quant``)."""
    tiny = device.type != "cuda" or quick
    warmup, steps = schedule(tiny, warmup, steps)
    quant = quantization.quant_arg(quant)
    kinds = streams_of(stream)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("the end-to-end benchmark needs transformers (pip install transformers)")
        return []
    records = []
    for name in models or MODELS:
        for kind in kinds:
            batches = stream_batches(name, kind, tiny, warmup + steps, device)
            for column in columns(device, only_columns):
                if why_not_on(column, name):
                    continue
                gc.collect()  # every column starts from a collected heap, the first one too
                records.append(_run_column(name, kind, column, device, tiny, batches, warmup, quant))
                _print(records[-1])
                gc.collect()  # hooks and bound methods (fastft's, Liger's, PEFT's) make cycles: free them now
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return records


def _run_column(name: str, kind: str, column: str, device, tiny: bool, batches: list, warmup: int, quant=None) -> dict:
    if COLUMNS[column].own_process is not None:  # unsloth: a process of its own builds and trains, same stream
        return COLUMNS[column].own_process(name, kind, column, device, tiny, batches, warmup, quant=quant)
    _reset_compiles()
    (model, lora), restore = build(name, column, device, tiny, quant=quant)
    dtype = str(next(model.parameters()).dtype).split(".")[-1]
    nan = [float("nan")] * len(batches)
    failed = Steps(nan, nan, [0] * len(batches), [0] * len(batches), -1)
    error = None
    try:
        result = train_primed(model, [step_inputs(column, b, name, tiny) for b in batches], warmup, device)
    except torch.OutOfMemoryError:
        result, error = failed, "out of memory"
    except Exception as e:  # a peer's own failure (e.g. flash-linear-attention refusing Hopper) is its row's result
        if COLUMNS[column].fastft:
            raise
        result, error = failed, f"{type(e).__name__}: {e}"
    finally:
        restore()
        del model
    row = record(name, kind, column, tiny, batches, warmup, result, dtype, lora, quant)
    return row if error is None else {**row, "error": error}


def record(
    name: str, kind: str, column: str, tiny: bool, batches: list, warmup: int, result: Steps, dtype: str, lora, quant
) -> dict:
    """The record of ``column`` on the model ``name`` and stream ``kind`` (one row of ``format_table``) from
    what ``train`` measured on ``batches``; ``dtype``: the model's parameters' (``"bfloat16"``)."""
    timed = batches[warmup:]
    timed_s = sum(result.seconds[warmup:])
    tokens = [b.num_tokens for b in timed]
    fed = [sum(p["input_ids"].numel() for p, _ in micro_batches(step_inputs(column, b, name, tiny))) for b in timed]
    return {
        "model": name,
        "stream": kind,
        "column": column,
        "leaks": leaks(column, name) is not None,  # documents of a row see each other (see fastft.bench.columns)
        "padded": COLUMNS[column].padded,  # trained on the documents padded, in micro-batches
        "padding": 1 - sum(tokens) / sum(fed),  # share of the timed steps' model inputs that is padding
        "layers": model_config(name, tiny).num_hidden_layers,
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


def _print(r: dict) -> None:
    memory = f"peak {r['peak_gib']:6.2f} GiB" if r["peak_gib"] is not None else "peak n/a (no GPU)"
    compiles = f"  torch.compile {r['compiles_first']} + {r['compiles_timed']}" if _compiled(r) else ""
    if _captured(r):
        compiles += f"  graph captures {r['captures_first']} + {r['captures_timed']}"
    leak = "  (leaks across documents)" if r.get("leaks") else ""
    if r.get("error"):
        print(f"{r['model']:14s} {r['stream']:12s} {r['column'] + leak:22s} failed: {r['error']}", flush=True)
        return
    print(
        f"{r['model']:14s} {r['stream']:12s} {r['column'] + leak:22s} {r['tokens_per_s']:9.0f} tok/s "
        f"{r['step_ms']:9.1f} ms/step  first {r['warmup']} steps {r['first_steps_s']:7.1f} s  {memory}{compiles}  "
        f"loss {r['loss']:.5f}",
        flush=True,
    )


def _compiled(r: dict) -> bool:
    return bool(r["compiles_first"] or r["compiles_timed"])


def _captured(r: dict) -> bool:
    return bool(r["captures_first"] or r["captures_timed"])


def _tolerance(dtype: str) -> float:
    return 2e-2 if dtype == "bfloat16" else 1e-4


REFERENCES = ("naive glue", "stock sdpa", "stock sdpa, padded")  # the loss check's, first that ran and is correct


def loss_check(records: list[dict]) -> tuple[bool, str]:
    """(fastft agrees, one line per model and stream): each column's loss at every step on the same weights
    and stream against the first of ``REFERENCES`` that ran and does not leak (``leaks``): ``naive glue``
    (documents kept apart by a plain mask; not on models whose layers mix tokens outside attention),
    ``stock sdpa`` (not there either, nor on gpt-oss, whose stock attention lets documents see each other),
    ``stock sdpa, padded`` (each document in its own row), within 1e-4 relative in fp32 and 2e-2 in bf16
    (kernels sum in other orders). A fastft column outside that at any step fails the check; another column
    outside it is reported (a leaking one as such)."""
    ok, lines = True, []
    for name, kind in dict.fromkeys((r["model"], r["stream"]) for r in records):
        rows = {
            r["column"]: r
            for r in records
            if (r["model"], r["stream"]) == (name, kind) and all(map(math.isfinite, r["losses"]))
        }
        reference = next((c for c in REFERENCES if c in rows and not leaks(c, name)), None)
        if reference is None:
            continue
        base = rows[reference]
        tol = _tolerance(base["dtype"])
        parts = []
        for column, r in rows.items():
            if column == reference:
                continue
            rel = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(r["losses"], base["losses"])]
            worst = max(range(len(rel)), key=rel.__getitem__)
            good = rel[worst] <= tol
            note = f"'{column}' {rel[worst]:.1e} (step {worst})"
            if COLUMNS[column].fastft:
                ok &= good
                parts.append(note + ("" if good else " FAILS"))
            else:
                leak = " (leaks across documents)" if r.get("leaks") else ""
                parts.append(note + leak + ("" if good or leak else " (differs)"))
        lines.append(
            f"loss check {name}, {kind}: largest relative difference to {reference} over {len(base['losses'])} "
            f"steps (tolerance {tol:g}; first loss {base['losses'][0]:.5f}): " + ", ".join(parts)
        )
    return ok, "\n".join(lines)


LEGEND = """the e2e table:
  tokens/s         real tokens of the timed steps over their wall time (steady state on the stream)
  step ms          mean wall time of a timed step
  first steps s    wall time of the untimed first steps (how many in brackets), on a GPU with the first pass over
                   the stream at learning rate 0 before them: compiles, autotune, CUDA graph captures
  torch.compile    graphs torch.compile compiled in the first pass and steps + in the timed steps ('-': none)
  graph captures   fastft.graphs captures (one per layer and signature) in the first steps + in the timed
                   steps ('-': none)
  ms / fastft's    this column's step ms over the fastft column's, same model and stream (above 1.00x: slower)
  vs fastest peer  fastft columns: this column's tokens/s / the highest tokens/s among the peer columns (stock *,
                   liger + stock flex) that do not leak, on the same model and stream, that peer named (above
                   1.00x: fastft is faster)
  (leaks across documents)  after a column: on this model its packed rows let each document see the ones
                   before it (stock packing on models whose layers mix tokens outside attention, e.g. Qwen3.5's
                   Gated DeltaNet; stock gpt-oss); its losses are not the documents' own
  padded           the padded columns' tokens/s counts the documents' tokens only; padding is the share of
                   their model inputs that is padding"""


def format_table(records: list[dict]) -> str:
    """One row per (model, stream, column); ``LEGEND`` says what each column of it holds."""
    by = {(r["model"], r["stream"], r["column"]): r for r in records}
    lines = [
        "| model | layers | stream | tokens/step | column | tokens/s | step ms | first steps s | torch.compile "
        "| graph captures | peak GiB | ms / fastft's | vs fastest peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        key = (r["model"], r["stream"])
        ours = by.get((*key, "fastft"))
        ratio = f"{r['step_ms'] / ours['step_ms']:.2f}x" if ours and r["column"] != "fastft" else "-"
        peers = [
            p
            for p in records
            if (p["model"], p["stream"]) == key
            and COLUMNS[p["column"]].peer
            and not p.get("leaks")
            and math.isfinite(p["tokens_per_s"])
        ]
        best = max(peers, key=lambda p: p["tokens_per_s"]) if peers else None
        versus = (
            f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x ({best['column']})"
            if best and COLUMNS[r["column"]].fastft
            else "-"
        )
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        tokens = f"{r['tokens_min']}" if r["tokens_min"] == r["tokens_max"] else f"{r['tokens_min']}-{r['tokens_max']}"
        compiles = f"{r['compiles_first']} + {r['compiles_timed']}" if _compiled(r) else "-"
        captures = f"{r['captures_first']} + {r['captures_timed']}" if _captured(r) else "-"
        column = r["column"] + (" (leaks across documents)" if r.get("leaks") else "")
        if r.get("padded"):
            column += f" ({r['padding']:.0%} padding)"
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['stream']} | {tokens} | {column} | {r['tokens_per_s']:.0f} | "
            f"{r['step_ms']:.1f} | {r['first_steps_s']:.1f} ({r['warmup']}) | {compiles} | {captures} | {peak} | "
            f"{ratio} | {versus} |"
        )
    return "\n".join(lines)


def chart(records: list[dict], path: str) -> bool:
    """Bar chart of tokens/s per (model, stream) and column, if matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = list(dict.fromkeys((r["model"], r["stream"]) for r in records))
    names = [c for c in COLUMNS if any(r["column"] == c for r in records)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for i, c in enumerate(names):
        values = [_find(records, g, c).get("tokens_per_s", 0) for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=c)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))], [f"{m}\n{s}" for m, s in groups])
    ax.set_ylabel("tokens/s (stream, steady state)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def _find(records: list[dict], group: tuple, column: str) -> dict:
    return next((r for r in records if (r["model"], r["stream"]) == group and r["column"] == column), {})
