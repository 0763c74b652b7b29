"""Host cost per call of the building blocks of a launch on this machine (torch.empty, one eager kernel,
Triton launches, Tensor.split) next to fastft.moe_route and the argsort+bincount baseline. GPU only."""

import statistics
import time

import torch
import triton
import triton.language as tl


def host(fn, iters=500):
    for _ in range(20):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


@triton.jit
def k1(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + i, i, mask=i < n)


@triton.jit
def k12(a, b, c, d, e, f, g, h, i_, j, k, m, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(a + i, i, mask=i < m)


x = torch.empty(4096, dtype=torch.int32, device="cuda")
print("torch.empty", host(lambda: torch.empty(4096, dtype=torch.int32, device="cuda")))
print("x.add_(1)", host(lambda: x.add_(1)))
print("triton k1[grid] 2 args", host(lambda: k1[(4,)](x, 4096, BLOCK=1024)))
print("triton k12[grid] 12 args", host(lambda: k12[(4,)](x, x, x, x, x, x, x, x, x, x, x, 4096, BLOCK=1024)))
c = k1[(4,)](x, 4096, BLOCK=1024)
print("compiled kernel[grid] 2 args", host(lambda: c[(4, 1, 1)](x, 4096, 1024)))
print(
    "compiled kernel's launcher (.run) 2 args",
    host(
        lambda: c.run(
            4,
            1,
            1,
            torch._C._cuda_getCurrentRawStream(0),
            c.function,
            c.packed_metadata,
            None,
            None,
            None,
            x,
            4096,
            1024,
        )
    ),
)
print("x.split 6", host(lambda: x.split([1, 2, 3, 4, 5, 4081])))
import fastft
from fastft.bench.routing import router_ids

ids = router_ids(16384, 128, 8, "cuda")
print("moe_route", host(lambda: fastft.moe_route(ids, 128)))
print(
    "argsort+bincount+cumsum",
    host(lambda: (ids.flatten().argsort(stable=True), ids.flatten().bincount(minlength=128).cumsum(0))),
)
from fastft import packing

doc = fastft.packed_seq_info(position_ids=torch.arange(32768, device="cuda") % 512).doc_ids.view(1, -1)
print(
    "flex_block_mask tables+BlockMask T=32768",
    host(lambda: packing.make_block_mask(packing.block_tables_op(doc, 0, 128, "triton"), doc, 0, 128)),
)
print("  tables op only", host(lambda: packing.block_tables_op(doc, 0, 128, "triton")))
from fastft.kernels._launch import launch

print("fastft launch() of k1", host(lambda: launch(k1, (4,), x, 4096, BLOCK=1024)))
