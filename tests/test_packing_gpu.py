"""fastft.packing on a CUDA GPU: sync-freedom, the attention backends it feeds, torch.compile with inductor."""

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

import fastft
from fastft import selfcheck, testing
from fastft.testing import no_host_sync
from fastft.testing import packed_position_ids as documents

pytestmark = pytest.mark.gpu


def _syncs(fn) -> int:
    """Number of synchronizing CUDA calls ``fn`` makes."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)


def test_sync_budget():
    pos = documents(4096, 9, "cuda")
    lengths = fastft.packed_seq_info(position_ids=pos).seq_lengths.tolist()

    def from_host():
        info = fastft.packed_seq_info(seq_lengths=lengths, num_tokens=4100, device="cuda")
        info.cu_seqlens, info.max_seqlen, info.doc_ids, info.sdpa_mask(64), info.flex_block_mask(), info.varlen_kwargs()

    assert _syncs(from_host) == 0
    assert (
        _syncs(lambda: fastft.packed_seq_info(cu_seqlens=[0, 5, 9], max_seqlen=5, device="cuda").varlen_kwargs()) == 0
    )

    fresh = pos.clone()

    def device_masks():
        info = fastft.packed_seq_info(position_ids=fresh)
        info.doc_ids, info.position_ids, info.sdpa_mask(), info.sdpa_mask(16, torch.bfloat16), info.flex_block_mask(32)

    assert _syncs(device_masks) == 0
    assert _syncs(lambda: fastft.packed_seq_info(position_ids=fresh).varlen_kwargs()) == 1
    device_cu = torch.tensor([0, 5, 9], device="cuda")
    assert _syncs(lambda: fastft.packed_seq_info(cu_seqlens=device_cu)) == 1


def test_32_layer_loop_never_syncs_after_the_first():
    pos = documents(16384, 32, "cuda", rows=2)
    first = fastft.packed_seq_info(position_ids=pos)
    first.varlen_kwargs(), first.sdpa_mask(), first.flex_block_mask()
    with no_host_sync():
        for _ in range(32):
            info = fastft.packed_seq_info(position_ids=pos)
            assert info is first
            info.varlen_kwargs(), info.sdpa_mask(), info.flex_block_mask(), info.cu_seqlens, info.max_seqlen


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("window", [None, 100])
def test_varlen_attn_matches_sdpa_with_mask(window):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    t, h, d = 2048, 4, 64
    info = fastft.packed_seq_info(position_ids=documents(t, 7, "cuda"))
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = info.varlen_kwargs(window)
    params = inspect.signature(varlen.varlen_attn).parameters
    extra = {"window_size": kw["window_size"]} if "window_size" in params else {"is_causal": True}
    if window and "window_size" not in params:
        pytest.skip("this torch's varlen_attn has no window_size")
    out = varlen.varlen_attn(
        q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"], kw["max_seqlen_k"], **extra
    )
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=info.sdpa_mask(window)
    )[0].transpose(0, 1)
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("window", [None, 300])
def test_flex_attention_with_block_mask_matches_sdpa(window):
    from torch.nn.attention.flex_attention import flex_attention

    b, h, t, d = 2, 4, 1536, 64
    info = fastft.packed_seq_info(position_ids=documents(t, 5, "cuda", rows=b))
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, block_mask=info.flex_block_mask(window))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=info.sdpa_mask(window))
    assert _rel_err(out, ref) < 1e-2


def test_torch_compile_inductor_fullgraph():
    def layer(position_ids):
        info = fastft.packed_seq_info(position_ids=position_ids)
        return info.sdpa_mask(window=64).float().sum(), info.flex_block_mask().kv_num_blocks, info.doc_ids * 2

    pos = documents(4096, 11, "cuda", rows=2)
    compiled = torch.compile(layer, fullgraph=True)
    testing.assert_same(list(compiled(pos)), list(layer(pos)))


def test_mask_addresses_past_2_31_elements():
    b, t = 9, 16384  # 2.4e9 mask elements
    pos = torch.cat([documents(t, 40, "cuda", rows=1) for _ in range(b)])
    info = fastft.packed_seq_info(position_ids=pos)
    mask = info.sdpa_mask(window=1000)
    rows = torch.tensor([0, 1, 4095, 8191, 16383], device="cuda")
    for bi in (0, b - 1):
        doc = info.doc_ids[bi]
        k = torch.arange(t, device="cuda")
        want = (doc[rows, None] == doc[None, :]) & (k[None] <= rows[:, None]) & (rows[:, None] - k[None] < 1000)
        assert torch.equal(mask[bi, 0, rows], want)


def test_large_batches_match_torch(rng):
    g = rng
    for t in (100_000, 1_000_003):
        pos = testing.random_position_ids(g, None, t, 4000).cuda()
        testing.differential(
            lambda backend: selfcheck.packing_outputs({"position_ids": pos}, windows=(), backend=backend)
        )
        lengths = testing.random_seq_lengths(g, t, 3000)
        testing.differential(
            lambda backend: selfcheck.packing_outputs(
                {"seq_lengths": lengths, "num_tokens": t, "device": "cuda"}, windows=(), backend=backend
            )
        )
    pos = testing.random_position_ids(g, 2, 16384, 3000).cuda()
    testing.differential(
        lambda backend: selfcheck.packing_outputs(
            {"position_ids": pos}, windows=(None, 777), block_sizes=(128,), mask_dtypes=(), backend=backend
        )
    )
