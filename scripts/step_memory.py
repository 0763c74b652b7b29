"""What a column's training step holds on the GPU: allocated before the step, the allocator's peak in it, and the
reserved peak (what ``e2e`` reports: graph pools and the cache included), and what is reserved after the
step by pool (the allocator's cache, CUDA graph pools) beside fastft's static buffers.

    PYTHONPATH=$PWD python3 scripts/step_memory.py --model Qwen3-0.6B --column 'fastft + liger, graphs' [--live]

Draws three batches of the padding-free stream, trains two passes over them (graphed columns capture there),
then measures one step on the first batch. ``--live``: also record the allocator's history in that step and
group the step's own allocations live at its peak by their first frame outside torch. On torch 2.11 recording
failed inside an eager column's checkpoint recompute (``SystemError``, docs/benchmarks.md, 2026-11-25, fifth
session); graphed columns record fine.
"""

import argparse
import collections

import torch

from fastft.e2e import stacks, train
from fastft.e2e.models import MODEL_CONFIGS
from fastft.e2e.stream import model_stream
from fastft.graphs import memory as graph_memory

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="Qwen3-0.6B", choices=list(MODEL_CONFIGS))
p.add_argument("--column", default="fastft + liger", choices=list(stacks.COLUMNS))
p.add_argument("--quant", default=None, choices=["nf4"])
p.add_argument("--live", action="store_true", help="group the allocations live at the step's peak by source")
args = p.parse_args()
if not torch.cuda.is_available():
    raise SystemExit("step_memory.py needs a GPU")
device = torch.device("cuda")
stream = model_stream(args.model, "padding-free", False, device)
batches = [next(stream) for _ in range(3)]
(model, _), restore = stacks.build(args.model, args.column, device, False, quant=args.quant)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def step(batch):
    train.train_step(model, opt, stacks.column_inputs(args.column, batch, args.model, False))


def source(frames) -> str:
    for f in frames:
        if "/torch/" not in f["filename"] and "<" not in f["filename"]:
            return f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}"
    return "torch internals"


for batch in batches * 2:
    step(batch)
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
before = torch.cuda.memory_allocated()
if args.live:
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
step(batches[0])
torch.cuda.synchronize()
gib = 2**30
print(
    f"{args.model}, '{args.column}'{', ' + args.quant if args.quant else ''}: allocated before the step "
    f"{before / gib:.2f} GiB, allocated peak {torch.cuda.max_memory_allocated() / gib:.2f} GiB, reserved peak "
    f"{torch.cuda.max_memory_reserved() / gib:.2f} GiB"
)
pools = collections.Counter()  # reserved now, by pool: the allocator's cache (pool id (0, 0)) or CUDA graph pools
for segment in torch.cuda.memory_snapshot():
    pools[tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0)] += segment["total_size"]
print(
    f"  reserved after the step: the allocator's cache {pools[False] / gib:.2f} GiB, CUDA graph pools "
    f"{pools[True] / gib:.2f} GiB; fastft's static buffers (in the cache) {graph_memory.static_bytes() / gib:.2f} GiB"
)
if args.live:
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, now, top, at_top = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], source(event.get("frames", [])))
            now += event["size"]
            if now > top:
                top, at_top = now, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            now -= live.pop(event["addr"])[0]
    print(f"  the step's own allocations live at its peak: {top / gib:.2f} GiB, by source:")
    by_source = collections.Counter()
    for size, where in at_top.values():
        by_source[where] += size
    for where, size in by_source.most_common(12):
        print(f"    {size / 2**20:9.1f} MiB  {where}")
restore()
