"""Probe (GPU): does a Triton grouped GEMM that gathers its rows through the routing (no permuted copy) and
applies SwiGLU in its epilogue beat fastft's experts chain (moe_permute -> torch._grouped_mm -> fastft.swiglu)?

    PYTHONPATH=$PWD python3 scripts/experts_gather_gemm.py [Qwen3-30B-A3B] [Qwen3.5-MoE] [Qwen3-30B-A3B@4k]

A forward-only prototype kept for the measurement (docs/benchmarks.md, 2026-11-25, fourth session): on an
H100 its best tile ran the experts' forward 1.01-1.05x the chain, too little to build the op on (issue #29).
It sweeps a few tiles over rows grouped in blocks (``moe_route(block_size=BM)``), checks its rows against the
chain's, and times the gate-up stage and the whole forward (down projection and combine included) both ways.
"""

import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

import fastft
from fastft.routing import moe_permute, moe_route, moe_unpermute


@triton.jit
def _gather_gate_up(
    x_ptr,
    w_ptr,
    pair_ptr,
    eob_ptr,
    out_ptr,
    gu_ptr,
    H,
    inter,
    TOPK,
    n_tiles,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SAVE: tl.constexpr,
    GATHER: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid // n_tiles
    pid_n = pid % n_tiles
    e = tl.load(eob_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BM + tl.arange(0, BM)
    if GATHER:
        pair = tl.load(pair_ptr + rows)
        src = tl.where(pair >= 0, pair // TOPK, 0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + src[:, None] * H + ks[None, :]
    wbase = w_ptr + e.to(tl.int64) * (2 * inter) * H
    g_ptrs = wbase + cols[None, :].to(tl.int64) * H + ks[:, None]
    u_ptrs = g_ptrs + inter * H
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, H, BK):
        a = tl.load(a_ptrs)
        g = tl.load(g_ptrs)
        u = tl.load(u_ptrs)
        acc_g = tl.dot(a, g, acc_g)
        acc_u = tl.dot(a, u, acc_u)
        a_ptrs += BK
        g_ptrs += BK
        u_ptrs += BK
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    o = rows[:, None].to(tl.int64) * inter + cols[None, :]
    tl.store(out_ptr + o, h.to(out_ptr.dtype.element_ty))
    if SAVE:
        o2 = rows[:, None].to(tl.int64) * (2 * inter) + cols[None, :]
        tl.store(gu_ptr + o2, acc_g.to(gu_ptr.dtype.element_ty))
        tl.store(gu_ptr + o2 + inter, acc_u.to(gu_ptr.dtype.element_ty))


def gather_gate_up(x, w, routing, BN, BK, warps, stages, save=False, gather=True):
    cap, inter, H = routing.capacity, w.shape[1] // 2, w.shape[2]
    BM = routing.block_size
    out = x.new_empty(cap, inter)
    gu = x.new_empty(cap, 2 * inter) if save else out
    n_tiles = inter // BN
    grid = (cap // BM * n_tiles,)
    _gather_gate_up[grid](
        x,
        w,
        routing.sorted_pair,
        routing.expert_of_block,
        out,
        gu,
        H,
        inter,
        routing.top_k,
        n_tiles,
        BM=BM,
        BN=BN,
        BK=BK,
        SAVE=save,
        GATHER=gather,
        num_warps=warps,
        num_stages=stages,
    )
    return out, gu


def main(name, T, E, K, H, inter):
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) * H**-0.5
    wd = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) * inter**-0.5
    logits = torch.randn(T, E, device=dev)
    ids = logits.topk(K, dim=-1).indices.int()
    wts = torch.rand(T, K, device=dev)

    def base_up():
        r = moe_route(ids, E)
        xp = moe_permute(x, r)
        gu = torch._grouped_mm(xp, w.transpose(-2, -1), offs=r.offsets[1:])
        return fastft.swiglu(gu), r

    def base_fwd():
        h, r = base_up()
        y = torch._grouped_mm(h, wd.transpose(-2, -1), offs=r.offsets[1:])
        return moe_unpermute(y, r, wts)

    ref_h, ref_r = base_up()
    ref_y = base_fwd()
    t_route1 = do_bench(lambda: moe_route(ids, E), rep=200)
    t_base_up = do_bench(base_up, rep=300)
    t_base_fwd = do_bench(base_fwd, rep=300)
    rb = moe_route(ids, E)
    xp = moe_permute(x, rb)
    t_gmm_only = do_bench(lambda: torch._grouped_mm(xp, w.transpose(-2, -1), offs=rb.offsets[1:]), rep=300)
    t_perm = do_bench(lambda: moe_permute(x, rb), rep=300)
    flops = 2 * T * K * H * 2 * inter
    print(f"{name}: T={T} E={E} K={K} H={H} inter={inter}")
    print(
        f"  route(bs=1) {t_route1:.3f} ms; permute {t_perm:.3f}; grouped_mm up alone {t_gmm_only:.3f} "
        f"({flops / t_gmm_only / 1e9:.0f} TFLOP/s); base up chain (route+permute+gmm+swiglu) {t_base_up:.3f}; "
        f"base fwd {t_base_fwd:.3f}"
    )
    results = []
    for BM in (64, 128):
        r = moe_route(ids, E, block_size=BM)
        for BN in (64, 128):
            if inter % BN:
                continue
            for BK in (64,):
                for warps in (4, 8):
                    for stages in (3, 4):
                        if BM == 128 and BN == 128 and stages == 4:
                            continue
                        try:
                            h, _ = gather_gate_up(x, w, r, BN, BK, warps, stages)
                            torch.cuda.synchronize()
                        except Exception as exc:  # noqa: BLE001
                            print("  fail", BM, BN, BK, warps, stages, type(exc).__name__, str(exc)[:80])
                            continue
                        # compare against base rows: slot s of r <-> same pair in ref routing
                        sp = r.sorted_pair
                        ok = sp >= 0
                        ref_slot = ref_r.inverse.flatten()[sp[ok].long()]
                        err = (h[ok].float() - ref_h[ref_slot.long()].float()).abs().max().item()
                        t = do_bench(lambda: gather_gate_up(x, w, r, BN, BK, warps, stages), rep=300)
                        ts = do_bench(lambda: gather_gate_up(x, w, r, BN, BK, warps, stages, save=True), rep=300)
                        results.append((t, BM, BN, BK, warps, stages, ts, err))
    results.sort()
    for t, BM, BN, BK, warps, stages, ts, err in results[:6]:
        print(
            f"  gather BM={BM} BN={BN} BK={BK} w={warps} s={stages}: {t:.3f} ms ({flops / t / 1e9:.0f} TFLOP/s), "
            f"with gate_up saved {ts:.3f}; max err {err:.3g}"
        )
    t, BM, BN, BK, warps, stages, ts, err = results[0]
    r = moe_route(ids, E, block_size=BM)
    t_route_bm = do_bench(lambda: moe_route(ids, E, block_size=BM), rep=200)
    xpp = moe_permute(x, r)
    t_contig, _ = min(
        (do_bench(lambda: gather_gate_up(xpp, w, r, BN, BK, warps, stages, gather=False), rep=300), 0) for _ in range(1)
    )

    def new_fwd():
        rr = moe_route(ids, E, block_size=BM)
        h, _ = gather_gate_up(x, w, rr, BN, BK, warps, stages)
        y = torch._grouped_mm(h, wd.transpose(-2, -1), offs=rr.padded_offsets[1:])
        return moe_unpermute(y, rr, wts)

    y = new_fwd()
    t_new_fwd = do_bench(new_fwd, rep=300)
    print(f"  same tile without the gather (rows pre-permuted): {t_contig:.3f} ms; route(bs={BM}) {t_route_bm:.3f}")
    print(
        f"  up stage: base {t_base_up:.3f} vs route+gather {t_route_bm + t:.3f} -> {t_base_up / (t_route_bm + t):.2f}x"
    )
    print(
        f"  forward: base {t_base_fwd:.3f} vs gather {t_new_fwd:.3f} -> {t_base_fwd / t_new_fwd:.2f}x; "
        f"max |dy| {(y.float() - ref_y.float()).abs().max().item():.3g} (|y| max {ref_y.abs().max().item():.3g})"
    )


if __name__ == "__main__":
    shapes = {
        "Qwen3-30B-A3B": (16384, 128, 8, 2048, 768),
        "Qwen3.5-MoE": (16384, 256, 8, 2048, 512),
        "Qwen3-30B-A3B@4k": (4096, 128, 8, 2048, 768),
    }
    for n in sys.argv[1:] or shapes:
        main(n, *shapes[n])
