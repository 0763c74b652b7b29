"""Each step of one e2e column on the stream, printed as it ends: wall time, loss, torch.compile's graph count and
peak memory, for columns whose first steps compile for minutes (``liger + stock flex``), where ``e2e``
shows nothing until the column is done.

    PYTHONPATH=$PWD python3 scripts/stream_steps.py --model Qwen3-0.6B --column 'liger + stock flex' --steps 40
"""

import argparse
import time

import torch

from fastft.e2e import stacks, train
from fastft.e2e.models import MODEL_CONFIGS
from fastft.e2e.stream import model_stream

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", default="Qwen3-0.6B", choices=list(MODEL_CONFIGS))
p.add_argument("--column", default="liger + stock flex", choices=list(stacks.COLUMNS))
p.add_argument("--stream", default="padding-free", choices=["fixed", "padding-free"])
p.add_argument("--steps", type=int, default=40)
args = p.parse_args()
if not torch.cuda.is_available():
    raise SystemExit("stream_steps.py needs a GPU")
device = torch.device("cuda")
stream = model_stream(args.model, args.stream, False, device)
(model, _), restore = stacks.build(args.model, args.column, device, False)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
start = time.perf_counter()
for i in range(args.steps):
    t = time.perf_counter()
    value = train.train_step(model, opt, stacks.column_inputs(args.column, next(stream), args.model, False)).item()
    graphs = train.compiled_graphs()
    print(
        f"step {i}: {time.perf_counter() - t:.2f} s (total {time.perf_counter() - start:.0f} s), loss {value:.4f}, "
        f"compiled graphs {graphs}, peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB",
        flush=True,
    )
restore()
