"""Where one e2e training step's GPU time goes: the top operators and kernels by self CUDA time (GPU only).

    python3 scripts/profile_step.py --model Qwen3-14B --column 'fastft + liger' --quant nf4
    python3 scripts/profile_step.py --model Qwen3-8B --layers all --column 'fastft + liger, memory plan'

Builds the column as ``python -m fastft e2e`` does, trains two steps of its padding-free stream (host
lengths: a flattening collator's ``cu_seq_lens_q``; a memory plan is in force from the second), then profiles
one. Both aten operators and the kernels
under them are listed, so the sum of the listed times counts most kernels twice; the first line gives the wall
time and the kernel time (kernels only). ``fastft audit`` gives launches, syncs and the GPU-busy fraction.
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fastft.e2e import stacks, train
from fastft.e2e.models import MODEL_CONFIGS, layers_arg, parse_layers
from fastft.e2e.stream import model_stream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Qwen3-0.6B", choices=list(MODEL_CONFIGS))
    parser.add_argument("--column", default="fastft", choices=list(stacks.COLUMNS))
    parser.add_argument("--quant", default=None, choices=["nf4"])
    parser.add_argument("--layers", type=parse_layers, default=None, help="decoder layers kept: a number or 'all'")
    parser.add_argument("--top", type=int, default=18)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py needs a GPU")
    device = torch.device("cuda")
    layers = layers_arg(args.model, args.layers)
    (model, _), restore = stacks.build(args.model, args.column, device, False, quant=args.quant, layers=layers)
    batches = model_stream(args.model, "padding-free", False, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step():
        train.train_step(model, opt, stacks.column_inputs(args.column, next(batches), args.model, False, True))

    step()
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in prof.events() if e.device_type != torch.autograd.DeviceType.CPU)
    print(
        f"{args.model}, '{args.column}'{', ' + args.quant if args.quant else ''}: "
        f"wall {wall * 1000:.1f} ms (profiled), "
        f"kernels {kernels / 1000:.1f} ms"
    )
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
        print(f"{e.self_device_time_total / 1000:9.1f} ms {e.count:6d}  {e.key[:110]}")
    restore()


if __name__ == "__main__":
    main()
