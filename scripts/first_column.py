"""One e2e column run several times in one process (GPU): does a process's first pass pay what later ones do not?

    PYTHONPATH=$PWD python3 scripts/first_column.py --model gpt-oss-20b --column fastft --runs 3 --stream padding-free

Each run is ``fastft.e2e.run.run`` on the same seeded stream (3 first steps + 10 timed); since
``train_primed`` every run is primed, so pass ``--unprimed`` to see the effect itself (docs/benchmarks.md,
2026-11-25, third session).
"""

import argparse
import statistics
import time

import torch

from fastft.e2e import run, train

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="gpt-oss-20b")
p.add_argument("--column", default="fastft")
p.add_argument("--runs", type=int, default=3)
p.add_argument("--stream", default="padding-free")
p.add_argument("--unprimed", action="store_true", help="time the first pass itself (train, not train_primed)")
args = p.parse_args()
if args.unprimed:
    run.train_primed = lambda model, inputs, warmup, device, on_step=None: train.train(model, inputs, warmup, device)
start = time.time()
for i in range(args.runs):
    (r,) = run.run(torch.device("cuda"), False, [args.model], [args.column], stream=args.stream, warmup=3, steps=10)
    median = statistics.median(r["step_s"]) * 1000
    print(
        f"[{time.time() - start:6.1f} s] run {i}: mean {r['step_ms']:.1f} ms, median {median:.1f} ms a step", flush=True
    )
