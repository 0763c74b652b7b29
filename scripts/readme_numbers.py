"""The README's headline table, rendered from the main job's recorded runs (docs/e2e_runs.json).

    python scripts/readme_numbers.py                               # print it
    python scripts/readme_numbers.py --write                       # put it in README.md, between its markers
    python scripts/readme_numbers.py --add out/e2e.json --write    # a GPU run's --json record first

For each model and each kind of stack users run without fastft (stock transformers; Unsloth): the newest run
that timed such a column (one that keeps documents apart) and a fastft column on that model, and the fastest
of each there, as the run recorded them. Ratios are never taken across runs. Columns with LoRA on the
experts' weights train more than the others and are left out. tests/test_readme.py checks that the README
holds this output.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from fastft.e2e import unsloth

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "docs" / "e2e_runs.json"
README = ROOT / "README.md"
BEGIN = "<!-- readme_numbers.py: begin -->"
END = "<!-- readme_numbers.py: end -->"
ORDER = ["Qwen3-0.6B", "Llama-3.2-1B", "Qwen3-8B", "Qwen3-30B-A3B", "gpt-oss-20b", "Qwen3-14B", "Qwen3.5"]
ORDER.append("Qwen3.5-MoE")


def _kind(column: str) -> str | None:
    if column == "unsloth":
        return "Unsloth"
    if column.startswith(("stock", "liger + stock")):
        return "stock"
    if column.startswith("fastft") and "experts lora" not in column:
        return "fastft"
    return None


def _quant(row: dict) -> str | None:
    """The row's quantization, None for none (older records leave it out, ``--json`` writes "none")."""
    quant = row.get("quant")
    return None if quant in (None, "none") else quant


def _key(row: dict) -> tuple:
    return row["model"], row.get("stream"), _quant(row)


def _usable(row: dict) -> bool:
    return not row.get("leaks") and not row.get("error") and row.get("tokens_per_s") is not None


def _fastest(rows: list[dict], kind: str) -> dict | None:
    rows = [r for r in rows if _usable(r) and _kind(r["column"]) == kind]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def comparisons(runs: list[dict]) -> list[dict]:
    """One entry per model and peer kind: the peer's row and fastft's, from the newest run holding both."""
    keys = []
    for run in runs:
        for r in run["rows"]:
            key = _key(r)
            if key not in keys:
                keys.append(key)
    keys.sort(key=lambda k: (ORDER.index(k[0]) if k[0] in ORDER else len(ORDER), k[0], k[1] or "", k[2] or ""))
    out = []
    for key in keys:
        for kind in ("stock", "Unsloth"):
            for run in reversed(runs):  # newest first
                rows = [r for r in run["rows"] if _key(r) == key]
                peer, fastft = _fastest(rows, kind), _fastest(rows, "fastft")
                if peer and fastft:
                    out.append(dict(peer=peer, fastft=fastft, run=run))
                    break
    return out


def _model(row: dict) -> str:
    extra = [f"{row['layers']} layers"] if row.get("layers") else []
    if _quant(row):
        extra.append(_quant(row).upper())
    return f"{row['model']} ({', '.join(extra)})" if extra else row["model"]


def _peak(row: dict) -> str:
    return "?" if row.get("peak_gib") is None else f"{row['peak_gib']:.2f}"


def _gpu(device: str) -> str:
    """A run's device without the vendor and the architecture: "H100 80GB HBM3"."""
    return device.removeprefix("NVIDIA ").split(" (sm")[0]


def render(runs: list[dict]) -> str:
    used = [c["run"] for c in comparisons(runs)]
    devices = sorted({r["device"] for r in used})
    several = len(devices) > 1  # then each row names its GPU
    lines = [
        "| model | compared with | its tokens/s | fastft's tokens/s (column) | fastft / it | peak GiB, fastft / it |"
        + (" GPU |" if several else ""),
        "|---|---|---|---|---|---|" + ("---|" if several else ""),
    ]
    unprimed = fallback = False
    for c in comparisons(runs):
        peer, fastft = c["peer"], c["fastft"]
        mark = "" if c["run"].get("primed", True) else "‡"
        unprimed = unprimed or bool(mark)
        peer_name = f"`{peer['column']}`"
        if peer["column"] == "unsloth":
            # runs recorded without the backend ran on the same machines, without flash-attn or xformers
            on_fallback = "backend" not in peer or unsloth.on_fallback(peer)
            fallback = fallback or on_fallback
            peer_name = "Unsloth" + ("†" if on_fallback else "")
        ratio = fastft["tokens_per_s"] / peer["tokens_per_s"]
        lines.append(
            f"| {_model(peer)} | {peer_name} | {peer['tokens_per_s']:,.0f} | "
            f"**{fastft['tokens_per_s']:,.0f}** (`{fastft['column']}`){mark} | **{ratio:.2f}x**{mark} | "
            f"{_peak(fastft)} / {_peak(peer)} |" + (f" {_gpu(c['run']['device'])} |" if several else "")
        )
    dates = sorted({r["date"] for r in used})
    lines += [
        "",
        f"Real tokens per second of whole fine-tuning steps (forward, backward, AdamW; LoRA r=16, bf16) on one "
        f"{' or '.join(devices)}, {' to '.join(dict.fromkeys([dates[0], dates[-1]]))}: a padding-free stream of fresh "
        "batches (a new token count every step, up to 16,384 tokens), the same weights and batches "
        "for every column, each pair from one run; peak memory is what the process reserved. Commands, every "
        "column and the runs' caveats: "
        "[docs/benchmarks.md](docs/benchmarks.md#the-main-job), the rows: `docs/e2e_runs.json`.",
    ]
    if fallback:
        lines += [
            "",
            "† Unsloth on its attention fallback, one SDPA call per run of equal-length documents: the GPU machines "
            "have neither flash-attn nor xformers, the varlen kernels its users run it with.",
        ]
    if unprimed:
        lines += [
            "",
            "‡ a run from before each column was primed with a first pass over the stream: its first column paid "
            "one-time costs in its timed steps, so the ratio can overstate fastft's lead.",
        ]
    wrapped = [line if line.startswith("|") else textwrap.fill(line, 116, break_on_hyphens=False) for line in lines]
    return "\n".join(wrapped) + "\n"


def load(path: Path = RUNS) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def readme_table(text: str) -> str:
    """What README.md holds between the markers."""
    begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[begin:end].strip("\n") + "\n"


def add(record_path: Path, path: Path = RUNS) -> None:
    """Append the record ``python -m fastft e2e --json`` wrote to the runs (a GPU run: a CPU run's tiny configs
    time that each stack runs, not how fast)."""
    record = json.loads(Path(record_path).read_text())
    if not {"date", "device", "command", "rows"} <= set(record) or " CPU" in record["device"]:
        raise SystemExit(f"{record_path}: not the --json record of a GPU run of the main job")
    doc = json.loads(path.read_text())
    doc["runs"].append(record)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the table in README.md")
    parser.add_argument("--add", metavar="FILE", help="first append this --json record of a GPU run to the runs")
    args = parser.parse_args(argv)
    if args.add:
        add(Path(args.add))
    table = render(load())
    if not args.write:
        sys.stdout.write(table)
        return 0
    text = README.read_text()
    begin, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:begin] + "\n" + table + text[end:])
    print(f"wrote the table into {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
