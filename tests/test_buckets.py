"""fastft.graphs.buckets: the token-count ladder and the padding that forms documents of its own."""

import pytest
import torch

import fastft
from fastft.graphs import buckets


def test_token_bucket_ladder():
    for per_octave in (1, 2, 4, 8, 16):
        seen = set()
        for n in range(0, 4 * 1024 + 1):
            b = buckets.token_bucket(n, per_octave)
            assert n <= b and b - n < max(n, 1) / per_octave + 1e-9  # less than 1/per_octave of padding
            assert buckets.token_bucket(b, per_octave) == b  # a bucket is its own bucket
            if n < 2 * per_octave:
                assert b == n
            if 1024 < n <= 2048:
                seen.add(b)
        assert len(seen) == per_octave  # per octave (budget/2, budget]: per_octave counts (+1 with budget/2)
    assert [buckets.token_bucket(n) for n in (15, 16, 17, 14_500, 15_361, 16_384, 16_385)] == [
        15,
        16,
        18,
        15_360,
        16_384,
        16_384,
        18_432,
    ]


def test_bad_arguments():
    with pytest.raises(TypeError, match="tokens must be an int"):
        buckets.token_bucket(3.0)
    with pytest.raises(TypeError, match="tokens must be an int"):
        buckets.token_padding(True)
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        buckets.token_bucket(-1)
    with pytest.raises(ValueError, match="per_octave must be a power of two, got 6"):
        buckets.token_bucket(100, 6)
    pad = buckets.token_padding(17)
    with pytest.raises(ValueError, match="t has 16 entries along dim 1, expected 17"):
        pad.pad(torch.zeros(1, 16))
    with pytest.raises(ValueError, match="expected 18"):
        pad.unpad(torch.zeros(1, 17))
    with pytest.raises(ValueError, match=r"position_ids must be \[T\] or \[B, T\] with T=17"):
        pad.pad_positions(torch.zeros(1, 1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match="cu_seqlens must be a tensor, got list"):
        pad.pad_cu_seqlens([0, 17])
    with pytest.raises(ValueError, match="dim=2 is out of range"):
        pad.pad(torch.zeros(1, 17), dim=2)


def test_padding_forms_documents_of_its_own(rng):
    lengths = [5, 300, 61]  # 366 tokens: the ladder's step there is 32
    tokens = sum(lengths)
    pad = buckets.token_padding(tokens)
    assert (pad.tokens, pad.padded, pad.extra) == (366, 384, 18)
    positions = torch.cat([torch.arange(n) for n in lengths])
    for rows in (positions, positions[None].expand(2, -1)):
        padded = pad.pad_positions(rows)
        assert padded.shape == (*rows.shape[:-1], 384) and torch.equal(pad.unpad(padded, -1), rows)
        info = fastft.packed_seq_info(position_ids=padded)
        real = fastft.packed_seq_info(position_ids=rows)
        # the real documents are unchanged, and no padding token is in one of them
        assert torch.equal(pad.unpad(info.position_ids, -1), real.position_ids)
        doc = info.doc_ids.reshape(-1, 384)
        assert not set(doc[:, 366:].flatten().tolist()) & set(doc[:, :366].flatten().tolist())
        assert info.num_seqs == real.num_seqs + rows[..., :1].numel() and info.max_seqlen == 300
    assert buckets.token_padding(4000).extra == 96
    tail = buckets.token_padding(1000).pad_positions(torch.arange(1000))[1000:]  # 1000 -> 1024
    assert tail.tolist() == list(range(24))
    # the same documents from cu_seqlens: the padding's boundaries every PAD_DOCUMENT tokens
    p = buckets.TokenPadding(100, 400)
    cu = p.pad_cu_seqlens(torch.tensor([0, 30, 100], dtype=torch.int32))
    assert cu.tolist() == [0, 30, 100, 100, 228, 356, 400] and cu.dtype == torch.int32
    info = fastft.packed_seq_info(cu_seqlens=cu)
    assert info.seq_lengths.tolist() == [30, 70, 128, 128, 44]
    assert torch.equal(
        fastft.packed_seq_info(
            position_ids=p.pad_positions(torch.cat([torch.arange(30), torch.arange(70)]))
        ).cu_seqlens,
        info.cu_seqlens,
    )
    # pad and unpad along any dimension; nothing to pad: the same tensor
    x = torch.randn(2, 100, 3, generator=rng)
    padded = p.pad(x, dim=1, value=7.0)
    assert padded.shape == (2, 400, 3) and torch.equal(p.unpad(padded), x) and (padded[:, 100:] == 7).all()
    same = buckets.token_padding(64)
    view = x[:, :64]
    assert same.extra == 0 and same.pad(view) is view
    assert torch.equal(same.pad_positions(torch.arange(64)), torch.arange(64))
