"""Device time (CUDA graph replays) of moe_route's two kernels for BLOCK x SCAN_E at three shapes. GPU only."""

import torch

from fastft import routing
from fastft.bench.common import graph_ms
from fastft.bench.routing import router_ids
from fastft.kernels import routing as K  # noqa: E402

for e, k in [(128, 8), (256, 8), (32, 4)]:
    for t in (16384, 65536):
        ids = router_ids(t, e, k, "cuda")
        out, offsets, cap = routing.route_buffer(t, k, e, 1, "cuda")
        res = []
        for block in (1024, 2048, 4096):
            for scan_e in (64, 128):
                cfg = dict(BLOCK=block, SLOT_BLOCK=1024, SCAN_E=scan_e, num_warps=8)
                f = lambda: K.route(ids, e, 1, None, e, cap, out, offsets, **cfg)
                f()
                torch.cuda.synchronize()
                res.append(f"B{block}/S{scan_e}: {graph_ms(f) * 1000:.1f}")
        print(f"E={e} K={k} T={t}: " + "  ".join(res), flush=True)
