"""The main job's report: the table (``format_table``, ``legend``), the loss check with its one verdict line
(``loss_check``) and the chart (``chart``) of the records ``fastft.e2e.run.run`` gives.

The loss check: at every step, each column's loss against the first of ``REFERENCES`` that ran and does not
leak on that model (``fastft.e2e.stacks.leaks``), within ``tolerance``; a fastft column outside it, or one that
did not finish, fails the run. Speed ratios (``RATIOS``) compare a fastft column with the other columns of its
model and stream; a CPU run (tiny configs) shows none.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

from .stacks import COLUMNS, leaks
from .unsloth import on_fallback

REFERENCES = ("naive glue", "stock sdpa", "stock sdpa, padded")  # the loss check's, first that ran and is correct


def compiled(r: dict) -> bool:
    """Whether torch.compile compiled anything in the column of record ``r``."""
    return bool(r["compiles_first"] or r["compiles_timed"])


def captured(r: dict) -> bool:
    """Whether ``fastft.graphs`` captured anything in the column of record ``r``."""
    return bool(r["captures_first"] or r["captures_timed"])


def _tol(tol: float) -> str:
    """A tolerance as people write it: ``1e-4``, ``2e-2``."""
    mantissa, exponent = f"{tol:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def tolerance(dtype: str) -> float:
    """The loss check's relative tolerance for a reference in ``dtype``: kernels sum in other orders."""
    return 2e-2 if dtype == "bfloat16" else 1e-4


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One column's losses against its reference's on one model and stream."""

    model: str
    stream: str
    column: str
    reference: str
    worst: float  # largest relative difference over the steps (inf: the column has no finite loss)
    step: int  # the step of ``worst``
    tol: float
    fastft: bool  # a fastft column: outside ``tol`` fails the check
    leaks: bool
    error: str | None = None  # why the column did not finish

    @property
    def equal(self) -> bool:
        return self.error is None and self.worst <= self.tol

    def __str__(self) -> str:
        if self.error is not None:
            return f"'{self.column}' did not finish ({self.error})"
        note = f"'{self.column}' {self.worst:.1e} (step {self.step})"
        if self.fastft:
            return note + ("" if self.equal else " FAILS")
        leak = " (leaks across documents)" if self.leaks else ""
        return note + leak + ("" if self.equal or leak else " (differs)")


def compare(records: list[dict]) -> tuple[list[Comparison], list[str]]:
    """Every column against the first of ``REFERENCES`` that ran and does not leak on its model and stream
    (``naive glue``: documents kept apart by a plain mask, not on models whose layers mix tokens outside
    attention; ``stock sdpa``: not there either, nor on gpt-oss; ``stock sdpa, padded``: each document in its
    own row), and one line per model and stream saying so."""
    comparisons, lines = [], []
    for name, kind in dict.fromkeys((r["model"], r["stream"]) for r in records):
        rows = {r["column"]: r for r in records if (r["model"], r["stream"]) == (name, kind)}
        finite = {c for c, r in rows.items() if not r.get("error") and all(map(math.isfinite, r["losses"]))}
        reference = next((c for c in REFERENCES if c in finite and not leaks(c, name)), None)
        if reference is None:
            continue
        base = rows[reference]
        tol = tolerance(base["dtype"])
        group = []
        for column, r in rows.items():
            if column == reference:
                continue
            rel = [abs(a - b) / max(abs(b), 1e-6) for a, b in zip(r["losses"], base["losses"])]
            rel = [x if math.isfinite(x) else math.inf for x in rel]
            worst = max(range(len(rel)), key=rel.__getitem__)
            error = r.get("error") or (None if column in finite else "a loss is not finite")
            fastft = COLUMNS[column].fastft
            group.append(Comparison(name, kind, column, reference, rel[worst], worst, tol, fastft, r["leaks"], error))
        comparisons += group
        lines.append(
            f"  {name}, {kind}, against {reference} ({len(base['losses'])} steps, first loss "
            f"{base['losses'][0]:.5f}, tolerance {_tol(tol)}): " + ", ".join(map(str, group))
        )
    return comparisons, lines


def loss_check(records: list[dict]) -> tuple[bool, str]:
    """(whether every fastft column equals its reference, the report): one line per model and stream
    (``compare``) and last the verdict, ``loss check: PASS — ...``, ``loss check: FAIL — ...``, or
    ``loss check: not run — ...`` where no fastft column ran beside a reference (not a failure)."""
    comparisons, lines = compare(records)
    ours = [c for c in comparisons if c.fastft]
    failed = [c for c in ours if not c.equal]
    if lines:
        lines.insert(0, "largest relative difference of each column's loss to the reference's, over every step:")
    if not ours:
        verdict = "loss check: not run — no fastft column ran beside a reference column (" + ", ".join(REFERENCES) + ")"
    elif failed:
        said = "; ".join(f"{c.model}, {c.stream}: {c}" for c in failed)
        verdict = f"loss check: FAIL — {len(failed)} of {len(ours)} fastft columns differ from the reference: {said}"
    else:
        tols = sorted({c.tol for c in ours})
        within = " / ".join(map(_tol, tols)) + " relative"
        verdict = (
            f"loss check: PASS — {len(ours)} fastft {'column equals' if len(ours) == 1 else 'columns equal'} the "
            f"reference within {within} at every step "
            f"(largest difference {max(c.worst for c in ours):.1e})"
        )
    return not failed, "\n".join([*lines, verdict])


LEGEND = {
    "tokens/s": "real tokens of the timed steps over their wall time (steady state on the stream)",
    "step ms": "mean wall time of a timed step",
    "first steps s": "wall time of the untimed first steps (how many in brackets), on a GPU with the first pass "
    "over the stream at learning rate 0 before them: compiles, autotune, CUDA graph captures",
    "torch.compile": "graphs torch.compile compiled in the first pass and steps + in the timed steps ('-': none)",
    "graph captures": "fastft.graphs captures (one per layer and signature) in the first steps + in the timed "
    "steps ('-': none)",
    "x floor": "step ms over the step's compute floor: its model FLOPs (forward and input gradient of every GEMM, "
    "LoRA's weight gradients, softmax attention; no recomputation) at the GPU's measured dense bf16 GEMM rate "
    "(1.00x: nothing left but doing less math)",
    "ms / fastft's": "this column's step ms over the fastft column's, same model and stream (above 1.00x: slower)",
    "vs fastest peer": "fastft columns: this column's tokens/s / the highest tokens/s among the peer columns "
    "(stock *, liger + stock flex, unsloth) that do not leak, on the same model and stream, that peer named "
    "(above 1.00x: fastft is faster); 'unsloth, SDPA fallback': Unsloth ran without flash-attn or xformers "
    "(its packed attention one SDPA call per run of equal-length documents), not as its users run it",
    "(leaks across documents)": "after a column: on this model its packed rows let each document see the ones "
    "before it (stock packing on models whose layers mix tokens outside attention, e.g. Qwen3.5's Gated "
    "DeltaNet; stock gpt-oss); its losses are not the documents' own",
    "padded": "the padded columns' tokens/s counts the documents' tokens only; padding is the share of their "
    "model inputs that is padding",
}
RATIOS = ("x floor", "ms / fastft's", "vs fastest peer")


def legend(ratios: bool = True) -> str:
    """What each column of the e2e table holds (``ratios``: with the speed ratios')."""
    lines = ["the e2e table:"]
    for key, text in LEGEND.items():
        if ratios or key not in RATIOS:
            if len(key) > 16:  # the key on a line of its own
                lines.append(f"  {key}")
            first = f"  {key:16s} " if len(key) <= 16 else " " * 19
            lines.append(textwrap.fill(text, 110, initial_indent=first, subsequent_indent=" " * 19))
    return "\n".join(lines)


def _fastest_peer(records: list[dict], r: dict) -> str:
    key = (r["model"], r["stream"])
    peers = [
        p
        for p in records
        if (p["model"], p["stream"]) == key
        and COLUMNS[p["column"]].peer
        and not p.get("leaks")
        and math.isfinite(p["tokens_per_s"])
    ]
    if not peers or not COLUMNS[r["column"]].fastft:
        return "-"
    best = max(peers, key=lambda p: p["tokens_per_s"])
    name = best["column"] + (", SDPA fallback" if best["column"] == "unsloth" and on_fallback(best) else "")
    return f"{r['tokens_per_s'] / best['tokens_per_s']:.2f}x ({name})"


def format_table(records: list[dict], ratios: bool = True) -> str:
    """One row per (model, stream, column); ``legend`` says what each column of it holds. Without ``ratios``
    (tiny configs), no speed ratios, nor the columns that hold nothing in the run (on a CPU: peak memory,
    compiles, captures)."""
    by = {(r["model"], r["stream"], r["column"]): r for r in records}

    def ours_ratio(r):
        ours = by.get((r["model"], r["stream"], "fastft"))
        return f"{r['step_ms'] / ours['step_ms']:.2f}x" if ours and r["column"] != "fastft" else "-"

    def column(r):
        text = r["column"] + (" (leaks across documents)" if r.get("leaks") else "")
        return text + (f" ({r['padding']:.0%} padding)" if r.get("padded") else "")

    cells = {
        "model": lambda r: r["model"],
        "layers": lambda r: str(r["layers"]),
        "stream": lambda r: r["stream"],
        "tokens/step": lambda r: (
            f"{r['tokens_min']}" + ("" if r["tokens_min"] == r["tokens_max"] else f"-{r['tokens_max']}")
        ),
        "column": column,
        "tokens/s": lambda r: f"{r['tokens_per_s']:.0f}",
        "step ms": lambda r: f"{r['step_ms']:.1f}",
        "first steps s": lambda r: f"{r['first_steps_s']:.1f} ({r['warmup']})",
        "torch.compile": lambda r: f"{r['compiles_first']} + {r['compiles_timed']}" if compiled(r) else "-",
        "graph captures": lambda r: f"{r['captures_first']} + {r['captures_timed']}" if captured(r) else "-",
        "peak GiB": lambda r: f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a",
        "x floor": lambda r: (
            f"{r['step_ms'] / r['floor_ms']:.2f}x" if r.get("floor_ms") and math.isfinite(r["step_ms"]) else "n/a"
        ),
        "ms / fastft's": ours_ratio,
        "vs fastest peer": lambda r: _fastest_peer(records, r),
    }
    if not any(r.get("floor_ms") for r in records):
        del cells["x floor"]
    if not ratios:
        for key in RATIOS:
            cells.pop(key, None)
        empty = {"torch.compile": compiled, "graph captures": captured, "peak GiB": lambda r: r["peak_gib"]}
        for key, has in empty.items():
            if not any(has(r) for r in records):
                del cells[key]
    lines = ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]
    lines += ["| " + " | ".join(cell(r) for cell in cells.values()) + " |" for r in records]
    return "\n".join(lines)


def chart(records: list[dict], path: str) -> str | None:
    """A bar chart of tokens/s per (model, stream) and column written to ``path``; None when written, else why
    not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
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
    return None


def _find(records: list[dict], group: tuple, column: str) -> dict:
    return next((r for r in records if (r["model"], r["stream"]) == group and r["column"] == column), {})
