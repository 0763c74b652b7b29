"""Benchmark and autotune specs for MoE token routing (``fastft.routing``)."""

from __future__ import annotations

import torch

import fastft
from fastft import dispatch, routing
from fastft.e2e.models import MOE_SHAPES as SHAPES
from fastft.reference import routing as reference
from fastft.selfcheck import routing_fields
from fastft.testing import assert_same, router_ids

from .common import Row, copy_gbs, graph_ms, host_us, time_ms


# name -> (experts, top_k, hidden)
def torch_route(ids: torch.Tensor, experts: int):
    """The glue fastft replaces: a stable argsort, bincount (which syncs) and cumsum."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return order, counts, torch.cumsum(counts, 0)


def index_add_combine(ys: torch.Tensor, r, weights: torch.Tensor) -> torch.Tensor:
    """The combine fastft replaces: scale each slot by its weight and index_add_ it into its token."""
    pair = r.sorted_pair.long()
    out = torch.zeros(r.num_tokens, ys.shape[1], dtype=ys.dtype, device=ys.device)
    return out.index_add_(0, pair // r.top_k, ys * weights.reshape(-1)[pair, None].to(ys.dtype))


def run(device: torch.device, quick: bool) -> list[Row]:
    rows: list[Row] = []
    gpu = device.type == "cuda"
    backend = dispatch.backend_for(routing.OP_ROUTE, device)
    tokens = (64,) if quick else (4096, 16384, 65536)
    shapes = {"tiny": (8, 2, 64)} if quick else SHAPES
    copy_bw = copy_gbs(device)  # the bound for gathers

    def bw_note(nbytes: int, ms: float) -> str:
        if copy_bw is None:
            return ""
        gbs = nbytes / (ms * 1e6)
        note = f"{gbs:.0f} GB/s = {100 * gbs / copy_bw:.0f}% of copy ({copy_bw:.0f} GB/s)"
        if nbytes <= 2**31:  # a clone moving the same bytes pays the same fixed costs per call (launch, L2)
            same = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
            same_gbs = nbytes / (time_ms(lambda: same.clone(), device) * 1e6)
            note += f", {100 * gbs / same_gbs:.0f}% of a same-size copy ({same_gbs:.0f} GB/s)"
        return note

    for name, (experts, top_k, hidden) in shapes.items():
        for t in tokens:
            case = f"{name} T={t}"
            ids = router_ids(t, experts, top_k, device)
            r = fastft.moe_route(ids, experts)
            assert_same(routing_fields(r), routing_fields(fastft.moe_route(ids, experts, backend="torch")))

            # 1) routing metadata
            base = time_ms(lambda: torch_route(ids, experts), device)
            fast = time_ms(lambda: fastft.moe_route(ids, experts), device)
            host = host_us(lambda: fastft.moe_route(ids, experts), iters=200 if gpu else 3)
            note = f"host {host:.1f} us/call"
            if gpu:
                graph = graph_ms(lambda: fastft.moe_route(ids, experts))
                note += f", GPU {graph * 1000:.1f} us (CUDA graph)"
            rows.append(Row("moe_route", case, "argsort+bincount+cumsum", base, fast, backend, note))

            # 2) permute and its backward (a gather-sum)
            el = 2
            x = torch.randn(t, hidden, device=device, dtype=torch.bfloat16)
            n = t * top_k
            fast = time_ms(lambda: fastft.moe_permute(x, r), device)
            rows.append(
                Row(
                    "moe_permute",
                    case,
                    "x[sorted_pair // K]",
                    time_ms(lambda: x[r.sorted_pair.long() // top_k], device),
                    fast,
                    backend,
                    bw_note((t + n) * hidden * el, fast),
                )
            )
            ys = torch.randn(r.capacity, hidden, device=device, dtype=torch.bfloat16)
            fast = time_ms(lambda: routing.unpermute_op(ys, r.sorted_pair, r.inverse, None, backend), device)
            rows.append(
                Row(
                    "moe_permute backward",
                    case,
                    "index_add_ into dx",
                    time_ms(lambda: torch.zeros_like(x).index_add_(0, r.sorted_pair.long() // top_k, ys), device),
                    fast,
                    backend,
                    bw_note((n + t) * hidden * el, fast),
                )
            )

            # 3) unpermute (weighted combine) and its backward
            w = torch.rand(t, top_k, device=device)
            # exact on a GPU; Triton's CPU interpreter truncates fp32 -> bf16 (one ulp)
            assert_same(
                fastft.moe_unpermute(ys, r, w), reference.gather_sum(ys, r.inverse, w), rtol=0 if gpu else 2**-7
            )
            fast = time_ms(lambda: fastft.moe_unpermute(ys, r, w), device)
            rows.append(
                Row(
                    "moe_unpermute",
                    case,
                    "index_add_ combine",
                    time_ms(lambda: index_add_combine(ys, r, w), device),
                    fast,
                    backend,
                    bw_note((n + t) * hidden * el, fast),
                )
            )
            dy = torch.randn(t, hidden, device=device, dtype=torch.bfloat16)
            fast = time_ms(lambda: routing.unpermute_backward_op(dy, ys, r.sorted_pair, r.inverse, w, backend), device)
            rows.append(
                Row(
                    "moe_unpermute backward",
                    case,
                    "torch reference",
                    time_ms(lambda: reference.unpermute_backward(dy, ys, r.sorted_pair, top_k, w), device),
                    fast,
                    backend,
                    bw_note((t + 2 * n) * hidden * el, fast),
                )
            )
            del x, ys, dy
            if gpu:
                torch.cuda.empty_cache()
    return rows


# ---- autotune ---------------------------------------------------------------------------------------------


def tune_launchers(device: torch.device) -> dict:
    """op -> make(size) -> fn(cfg) that launches the op's kernel once with launch parameters ``cfg``
    (the sizes and the candidate grid are the op's ``autotune.Tunable``, in fastft/routing.py)."""
    from fastft.kernels import routing as kernels

    def route(n):
        ids = router_ids(n // 8, 128, 8, device)
        out, offsets, cap = fastft.routing.route_buffer(n // 8, 8, 128, 1, device)
        return lambda cfg: kernels.route(ids, 128, 1, None, 128, cap, out, offsets, **cfg)

    def rows_of(hidden, t=4096):
        # The row ops are tuned per row width H (their size key), at T=4096 tokens, top-8 of 128 experts.
        r = fastft.moe_route(router_ids(t, 128, 8, device), 128)
        return r, torch.randn(t, hidden, device=device, dtype=torch.bfloat16)

    def permute(hidden):
        r, x = rows_of(hidden)
        return lambda cfg: kernels.permute(x, r.sorted_pair, r.inverse, **cfg)

    def gather_sum(weighted):
        def make(hidden):
            r, _ = rows_of(hidden)
            ys = torch.randn(r.capacity, hidden, device=device, dtype=torch.bfloat16)
            w = torch.rand(r.num_tokens, 8, device=device) if weighted else None
            return lambda cfg: kernels.gather_sum(ys, r.inverse, w, **cfg)

        return make

    def unpermute_backward(hidden):
        r, dy = rows_of(hidden)
        ys = torch.randn(r.capacity, hidden, device=device, dtype=torch.bfloat16)
        w = torch.rand(r.num_tokens, 8, device=device)
        return lambda cfg: kernels.unpermute_backward(dy, ys, r.sorted_pair, r.inverse, w, **cfg)

    return {
        routing.OP_ROUTE: route,
        routing.OP_PERMUTE: permute,
        routing.OP_UNPERMUTE: gather_sum(True),
        routing.OP_PERMUTE_BACKWARD: gather_sum(False),
        routing.OP_UNPERMUTE_BACKWARD: unpermute_backward,
    }
