"""Device time (CUDA graph replays, no L2 flush) of the routing row kernels at the benchmark shapes, over
a grid of launch parameters; prints the best three per op as % of a 256 MiB clone. GPU only."""

import itertools

import torch

import fastft
from fastft.bench.common import graph_ms
from fastft.bench.routing import router_ids
from fastft.kernels import routing as K  # noqa: E402

x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
copy_gbs = 2 * x.numel() / (graph_ms(lambda: x.clone()) * 1e6)
print(f"copy {copy_gbs:.0f} GB/s", flush=True)
for name, e, k, h, t in [
    ("gpt-oss-20b", 32, 4, 2880, 4096),
    ("gpt-oss-20b", 32, 4, 2880, 16384),
    ("DeepSeek-V3", 256, 8, 7168, 4096),
    ("Qwen3", 128, 8, 2048, 4096),
]:
    r = fastft.moe_route(router_ids(t, e, k, "cuda"), e)
    xx = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ys = torch.randn(r.capacity, h, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(t, k, device="cuda")
    el = 2
    n = t * k
    ops = {
        "permute": (lambda cfg: K.permute(xx, r.sorted_pair, r.inverse, PAD_ROWS=256, **cfg), (t + n) * h * el),
        "permute_bwd": (lambda cfg: K.gather_sum(ys, r.inverse, None, **cfg), (t + n) * h * el),
        "unpermute": (lambda cfg: K.gather_sum(ys, r.inverse, w, **cfg), (t + n) * h * el),
        "unpermute_bwd": (
            lambda cfg: K.unpermute_backward(xx, ys, r.sorted_pair, r.inverse, w, PAD_ROWS=256, **cfg),
            (t + 2 * n) * h * el,
        ),
    }
    for op, (f, nbytes) in ops.items():
        res = []
        for rows, bh, nw in itertools.product((1, 2, 4), (512, 1024, 2048, 4096), (4, 8)):
            cfg = dict(ROWS=rows, BLOCK_H=bh, num_warps=nw)
            try:
                ms = graph_ms(lambda: f(cfg), rep_ms=30)
            except Exception:  # a config this GPU cannot run (e.g. out of resources)
                continue
            res.append((ms, rows, bh, nw))
        res.sort()
        best = res[:3]
        print(
            f"{name} T={t} {op}: "
            + "; ".join(f"R{r_}/H{b}/W{w_} {nbytes / (ms * 1e6) / copy_gbs * 100:.0f}%" for ms, r_, b, w_ in best),
            flush=True,
        )
