"""e2e MoE steps with fastft's experts path before and after ``fastft.swiglu`` (GPU), on one stream.

    PYTHONPATH=$PWD python3 scripts/experts_gate_e2e.py --steps 10 gpt-oss-20b Qwen3-30B-A3B

"before": ``gate_activation`` patched to give each experts block its own gate (transformers' torch ops);
"swiglu": as shipped; "swiglu, experts lora": LoRA on the experts too. Prints one JSON line per run.
"""

import argparse
import json
import statistics
from unittest import mock

import torch

from fastft.e2e import run
from fastft.integrations.transformers import experts as ft_experts

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--steps", type=int, default=10)
p.add_argument("models", nargs="+")
args = p.parse_args()
shipped = ft_experts.gate_activation


def own(block):
    return block._apply_gate if block.has_gate else block.act_fn


for model in args.models:
    for label, column, gate in [
        ("before", "fastft", own),
        ("swiglu", "fastft", shipped),
        ("swiglu, experts lora", "fastft, experts lora", shipped),
    ]:
        with mock.patch.object(ft_experts, "gate_activation", gate):
            (r,) = run.run(torch.device("cuda"), False, [model], [column], warmup=3, steps=args.steps)
        median = statistics.median(r["step_s"]) * 1000
        line = dict(model=model, run=label, tokens_per_s=round(r["tokens_per_s"]), median_ms=round(median, 1))
        print(json.dumps({**line, "peak_gib": round(r["peak_gib"], 2), "losses": r["losses"]}), flush=True)
