"""fastft.packing: the reference against a brute-force reading of the rules, the Triton backend against the
reference (hypothesis), the public API's validation, memoization and torch.compile tracing."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

import fastft
from fastft import selfcheck, testing
from fastft.reference import packing as reference

# ---- the specification, spelled out in Python loops ----------------------------------------------------


def brute_force(rows: list[list[int]], window: int):
    docs, positions, starts = [], [], []
    d, flat = -1, 0
    for row in rows:
        for j, p in enumerate(row):
            if j == 0 or p != row[j - 1] + 1:
                d += 1
                starts.append(flat)
            docs.append(d)
            positions.append(flat - starts[-1])
            flat += 1
    t = len(rows[0]) if rows else 0
    mask = [
        [
            [docs[b * t + q] == docs[b * t + k] and k <= q and (window <= 0 or q - k < window) for k in range(t)]
            for q in range(t)
        ]
        for b in range(len(rows))
    ]
    return docs, positions, starts + [flat], mask


@given(testing.position_ids_strategy(max_tokens=48), st.integers(-1, 8))
def test_reference_matches_the_rules(position_ids, window):
    rows = position_ids.reshape(-1, position_ids.shape[-1]).tolist() if position_ids.numel() else []
    docs, positions, cu, mask = brute_force(rows, window)
    if position_ids.numel() == 0:
        return
    doc, pos, starts, summary = reference.boundaries_from_position_ids(position_ids)
    assert summary.tolist() == [docs[-1] + 1, max(positions) + 1]
    assert doc.flatten().tolist() == docs and pos.flatten().tolist() == positions
    assert starts.tolist() == cu + [cu[-1]] * (starts.numel() - len(cu))
    if rows:
        assert reference.sdpa_mask(doc.reshape(len(rows), -1), window, torch.bool)[:, 0].tolist() == mask


def test_worked_example():
    info = fastft.packed_seq_info(position_ids=torch.tensor([[0, 1, 2, 0, 1], [5, 6, 0, 1, 2]]), backend="torch")
    assert info.doc_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 3, 3, 3]]
    assert info.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]
    assert info.cu_seqlens.tolist() == [0, 3, 5, 7, 10] and info.cu_seqlens.dtype == torch.int32
    assert info.seq_lengths.tolist() == [3, 2, 2, 3] and info.max_seqlen == 3 and info.num_seqs == 4
    m = info.sdpa_mask(window=2, dtype=torch.float32)
    assert m.shape == (2, 1, 5, 5)
    assert m[1, 0, 4].tolist() == [float("-inf"), float("-inf"), float("-inf"), 0.0, 0.0]
    assert info.varlen_kwargs(2)["window_size"] == (1, 0) and info.varlen_kwargs()["window_size"] == (-1, 0)


def test_lengths_tail_and_zero_lengths(device):
    info = fastft.packed_seq_info(seq_lengths=[3, 0, 2], num_tokens=8, device=device)
    assert info.cu_seqlens.tolist() == [0, 3, 5, 8] and info.num_seqs == 3 and info.max_seqlen == 3
    assert info.doc_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2] and info.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    same = fastft.packed_seq_info(cu_seqlens=torch.tensor([0, 3, 3, 5]), num_tokens=8, device=device)
    assert same.cu_seqlens.tolist() == [0, 3, 5, 8]


def test_no_tokens(device):
    for info in (
        fastft.packed_seq_info(seq_lengths=[], device=device),
        fastft.packed_seq_info(position_ids=torch.zeros(0, dtype=torch.long, device=device)),
    ):
        assert info.cu_seqlens.tolist() == [0] and info.num_seqs == 0 and info.max_seqlen == 0
        assert info.sdpa_mask().shape == (1, 1, 0, 0)
        with pytest.raises(ValueError, match="at least one token"):
            info.flex_block_mask()


# ---- Triton vs torch -------------------------------------------------------------------------------------


@given(testing.position_ids_strategy(), testing.window_strategy(), st.sampled_from([16, 32, 128]))
def test_triton_matches_torch_from_position_ids(device, position_ids, window, block_size):
    from fastft.packing import boundaries_op

    source = {"position_ids": position_ids.to(device)}
    if position_ids.numel():
        testing.differential(lambda backend: boundaries_op(source["position_ids"].contiguous(), backend))
    testing.differential(
        lambda backend: selfcheck.packing_outputs(
            source,
            windows=(window,),
            block_sizes=(block_size,),
            mask_dtypes=(torch.bool, torch.float16),
            backend=backend,
        )
    )


@given(testing.seq_lengths_strategy(), testing.window_strategy(), st.booleans())
def test_triton_matches_torch_from_lengths(device, lengths_and_tokens, window, as_cu):
    lengths, num_tokens = lengths_and_tokens
    values = [sum(lengths[:i]) for i in range(len(lengths) + 1)] if as_cu else lengths
    source = {"cu_seqlens" if as_cu else "seq_lengths": values, "num_tokens": num_tokens, "device": device}
    testing.differential(
        lambda backend: selfcheck.packing_outputs(source, windows=(window,), block_sizes=(16,), backend=backend)
    )


@given(testing.position_ids_strategy(max_tokens=40), st.integers(0, 3), st.sampled_from([1, 2, 8]))
def test_small_blocks_match_torch(device, position_ids, window, block_size):
    source = {"position_ids": position_ids.to(device)}
    testing.differential(
        lambda backend: selfcheck.packing_outputs(source, windows=(window,), block_sizes=(block_size,), backend=backend)
    )


@given(testing.position_ids_strategy(max_rows=2, max_tokens=200), testing.window_strategy(), st.sampled_from([16, 64]))
def test_block_mask_identical_to_create_block_mask(device, position_ids, window, block_size):
    if position_ids.numel() == 0:
        return
    info = fastft.packed_seq_info(position_ids=position_ids.to(device))
    doc = info.doc_ids.reshape(-1, position_ids.shape[-1])
    t = doc.shape[-1]
    expected = create_block_mask(
        fastft.document_mask_mod(doc, window), doc.shape[0], 1, t, t, device=device, BLOCK_SIZE=block_size
    )
    got = info.flex_block_mask(window, block_size)
    testing.assert_same(
        {f: getattr(got, f) for f in selfcheck.BLOCK_MASK_FIELDS},
        {f: getattr(expected, f) for f in selfcheck.BLOCK_MASK_FIELDS},
    )
    assert got.seq_lengths == (t, t) and got.BLOCK_SIZE == (block_size, block_size)


def test_random_cases_like_cli_check(device, rng):
    g = rng
    for _ in range(5):
        selfcheck.check_packing(g, device, 96)


# ---- the public API --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({}, ValueError, "exactly one of"),
        ({"seq_lengths": [1], "cu_seqlens": [0, 1]}, ValueError, "exactly one of"),
        ({"position_ids": [0, 1]}, TypeError, "position_ids must be a tensor"),
        (
            {"position_ids": torch.zeros(2, 2, 2, dtype=torch.long)},
            ValueError,
            r"position_ids must be \[T\] or \[B, T\]",
        ),
        ({"position_ids": torch.zeros(3)}, ValueError, "position_ids must have an integer dtype"),
        ({"position_ids": torch.arange(3), "num_tokens": 4}, ValueError, "num_tokens=4"),
        ({"position_ids": torch.arange(3), "max_seqlen": 3}, ValueError, "max_seqlen is only taken with cu_seqlens"),
        ({"seq_lengths": [2, -1]}, ValueError, "seq_lengths must be non-negative"),
        ({"seq_lengths": [2.0, 1]}, ValueError, "seq_lengths must be a list"),
        ({"seq_lengths": torch.tensor([2.0])}, ValueError, "seq_lengths must have an integer dtype"),
        ({"seq_lengths": torch.tensor([[2]])}, ValueError, "seq_lengths must be 1-D"),
        ({"seq_lengths": [3, 4], "num_tokens": 5}, ValueError, "seq_lengths covers 7 tokens, more than num_tokens=5"),
        ({"cu_seqlens": [1, 3]}, ValueError, "cu_seqlens must start at 0"),
        ({"cu_seqlens": []}, ValueError, "cu_seqlens must start at 0"),
        ({"cu_seqlens": [0, 3, 2]}, ValueError, "cu_seqlens must be non-decreasing"),
        ({"cu_seqlens": [0, 3, 5], "max_seqlen": 2}, ValueError, "max_seqlen=2 is less than the longest"),
        ({"cu_seqlens": [0, 3], "num_tokens": -1}, ValueError, "num_tokens must be an int >= 0"),
        ({"seq_lengths": [3], "backend": "cuda"}, ValueError, "backend must be one of"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        fastft.packed_seq_info(**kwargs)


def test_lengths_past_int32_are_refused_not_wrapped():
    # int64 sums of these wrap: the info had a negative num_tokens
    with pytest.raises(ValueError, match="seq_lengths holds 4611686018427387904; cu_seqlens is int32"):
        fastft.packed_seq_info(seq_lengths=[2**62, 2**62])
    with pytest.raises(ValueError, match="seq_lengths holds 4611686018427387904"):
        fastft.packed_seq_info(seq_lengths=torch.tensor([2**62, 2**62]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        fastft.packed_seq_info(cu_seqlens=[0, 2**63 - 1, -(2**63)])
    with pytest.raises(ValueError, match="does not fit int32"):
        fastft.packed_seq_info(cu_seqlens=[0, 2**62, 2**63 - 1])


def test_padded_keeps_the_layout_and_checks_its_arguments(device):
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]], device=device)
    info = fastft.packed_seq_info(position_ids=pos)
    padded = info.padded(8, 5)
    assert padded.doc_ids.shape == padded.position_ids.shape == (2, 5)  # [B, T] as the info's own
    assert torch.equal(padded.doc_ids, info.doc_ids) and torch.equal(padded.position_ids, info.position_ids)
    mask_mod = fastft.document_mask_mod(padded.doc_ids)
    assert bool(mask_mod(1, 0, torch.tensor(4), torch.tensor(2))) and not bool(mask_mod(1, 0, torch.tensor(2), 1))
    flat = fastft.packed_seq_info(seq_lengths=[3, 2], device=device).padded(4, 3)
    assert flat.doc_ids.shape == (5,) and flat.doc_ids.tolist() == [0, 0, 0, 1, 1]
    for fill in ("no", 0, None):  # booleans are checked as booleans
        with pytest.raises(TypeError, match="fill must be True or False"):
            info.padded(8, 5, out=torch.zeros(9, dtype=torch.int32, device=device), fill=fill)
    # refused before anything is allocated (2**31 sequences were an 8 GiB cu_seqlens)
    for num_seqs in (11, 2**31):
        with pytest.raises(ValueError, match=f"num_seqs={num_seqs} is more than this batch's 10 tokens"):
            info.padded(num_seqs, 5)


def test_validation_does_not_depend_on_earlier_calls():
    fastft.packed_seq_info(seq_lengths=[1, 2])  # a memo entry whose key equals the bad inputs' values
    fastft.packed_seq_info(cu_seqlens=[0, 4], max_seqlen=4)
    for bad in ([1.0, 2], [True, 2], (1, 2.0)):
        with pytest.raises(ValueError, match="seq_lengths must be a list/tuple of ints"):
            fastft.packed_seq_info(seq_lengths=bad)
    with pytest.raises(TypeError, match="max_seqlen must be an int, got float 4.0"):
        fastft.packed_seq_info(cu_seqlens=[0, 4], max_seqlen=4.0)
    with pytest.raises(ValueError, match="seq_lengths as a numpy array must be 1-D with an integer dtype"):
        fastft.packed_seq_info(seq_lengths=np.array([1.0, 2.0]))
    pos = torch.arange(4)
    fastft.packed_seq_info(position_ids=pos)
    with pytest.raises(ValueError, match="num_tokens=5 but position_ids has 4"):
        fastft.packed_seq_info(position_ids=pos, num_tokens=5)


def test_collator_integer_types_are_accepted():
    want = fastft.packed_seq_info(seq_lengths=[3, 2], backend="torch")
    for lengths in (
        np.array([3, 2]),
        np.array([3, 2], dtype=np.uint16),
        [np.int64(3), np.int32(2)],
        torch.tensor([3, 2], dtype=torch.uint32),
    ):
        info = fastft.packed_seq_info(seq_lengths=lengths, backend="torch")
        assert info.cu_seqlens.tolist() == want.cu_seqlens.tolist() and info.max_seqlen == 3
    info = fastft.packed_seq_info(cu_seqlens=np.array([0, 3, 5]), max_seqlen=np.int64(3), num_tokens=np.int64(6))
    assert info.cu_seqlens.tolist() == [0, 3, 5, 6] and info.max_seqlen == 3 and type(info.num_tokens) is int
    pos = torch.tensor([0, 1, 2, 0, 1], dtype=torch.uint32)
    assert fastft.packed_seq_info(position_ids=pos, backend="torch").doc_ids.tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="position_ids is on the meta device"):
        fastft.packed_seq_info(position_ids=torch.zeros(4, dtype=torch.long, device="meta"))


def test_document_mask_mod_checks_doc_ids():
    with pytest.raises(TypeError, match=r"doc_ids must be a \[B, T\] integer tensor, got NoneType"):
        fastft.document_mask_mod(None)
    with pytest.raises(ValueError, match=r"doc_ids must be a \[B, T\] integer tensor, got torch.int32 of shape \(4,\)"):
        fastft.document_mask_mod(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="doc_ids must be a"):
        fastft.document_mask_mod(torch.zeros(1, 4))


def test_bad_mask_arguments():
    info = fastft.packed_seq_info(seq_lengths=[3, 2])
    with pytest.raises(TypeError, match="dtype must be torch.bool or a floating dtype"):
        info.sdpa_mask(dtype=torch.int32)
    with pytest.raises(TypeError, match="window must be an int"):
        info.sdpa_mask(window=2.5)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # no -inf, or none the torch path can fill
        with pytest.raises(TypeError, match="floating dtype that holds -inf"):
            info.sdpa_mask(dtype=dtype)
    assert torch.equal(info.sdpa_mask(window=10**20), info.sdpa_mask())  # past int32: no window at all
    with pytest.raises(ValueError, match=r"out must be a contiguous int32 \[4\] tensor on cpu.*strides \(2,\)"):
        info.padded(3, 3, out=torch.zeros(8, dtype=torch.int32)[::2])
    for kwargs, name in (  # past int64 too: not an overflow error from deep inside torch
        (dict(seq_lengths=[2**70]), "seq_lengths"),
        (dict(cu_seqlens=[0, 2**64]), "cu_seqlens"),
        (dict(seq_lengths=np.array([2**63], dtype=np.uint64)), "seq_lengths"),
        (dict(seq_lengths=torch.tensor([2**40, 3])), "seq_lengths"),
    ):
        with pytest.raises(ValueError, match=f"{name} holds .*; cu_seqlens is int32"):
            fastft.packed_seq_info(**kwargs)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        info.flex_block_mask(block_size=0)


def test_immutable():
    info = fastft.packed_seq_info(seq_lengths=[3, 2])
    with pytest.raises(AttributeError, match="immutable"):
        info.max_seqlen = 7


def test_memoized_on_identity_and_version(device):
    pos = torch.tensor([0, 1, 2, 0, 1], device=device)
    info = fastft.packed_seq_info(position_ids=pos)
    mask = info.sdpa_mask()
    assert fastft.packed_seq_info(position_ids=pos) is info and info.sdpa_mask() is mask
    assert fastft.packed_seq_info(position_ids=pos.clone()) is not info
    pos[3:] = torch.tensor([3, 4])  # in place: now one document
    fresh = fastft.packed_seq_info(position_ids=pos)
    assert fresh is not info and fresh.num_seqs == 1 and info.num_seqs == 2
    assert fastft.packed_seq_info(seq_lengths=[3, 2]) is fastft.packed_seq_info(seq_lengths=[3, 2])
    assert fastft.packed_seq_info(seq_lengths=[3, 2]) is not fastft.packed_seq_info(seq_lengths=[3, 2], backend="torch")


def test_inference_mode_tensors_are_never_stale(device):
    with torch.inference_mode():
        pos = torch.tensor([0, 1, 2, 0, 1], device=device)
        assert fastft.packed_seq_info(position_ids=pos).num_seqs == 2
        pos[3:] = torch.tensor([3, 4])
        info = fastft.packed_seq_info(position_ids=pos)
        assert info.num_seqs == 1 and info.sdpa_mask().all(-1).any()


def test_torch_compile_traces_without_graph_breaks(device):
    def layer(position_ids):
        info = fastft.packed_seq_info(position_ids=position_ids)
        return info.sdpa_mask(window=4), info.flex_block_mask(block_size=16).kv_indices, info.doc_ids

    pos = testing.random_position_ids(torch.Generator().manual_seed(1), 2, 40, 12).to(device)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    testing.assert_same(list(compiled(pos)), list(layer(pos)))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_custom_ops_pass_opcheck(device, backend, rng):
    from fastft import packing

    pos = testing.random_position_ids(rng, 2, 40, 9).to(device)
    info = fastft.packed_seq_info(position_ids=pos, backend=backend)
    doc = info.doc_ids
    cases = [
        (packing.boundaries_op, (pos, backend)),
        (packing.from_cu_seqlens_op, (info.cu_seqlens, 80, backend)),
        (packing.sdpa_mask_op, (doc, 5, torch.bfloat16, backend)),
        (packing.block_tables_op, (doc, 0, 16, backend)),
    ]
    for fn, args in cases:
        torch.library.opcheck(fn.op, args)


@given(
    testing.position_ids_strategy(max_rows=2, max_tokens=64),
    testing.window_strategy(40),
    st.sampled_from([torch.bool, torch.float32]),
)
def test_sdpa_mask_small_tiles_match_reference(device, position_ids, window, dtype):
    # Small tiles so that most tiles are skipped as empty and the rest straddle document edges.
    if position_ids.numel() == 0:
        return
    from fastft.kernels import packing as kernels

    doc = fastft.packed_seq_info(position_ids=position_ids.to(device)).doc_ids.reshape(-1, position_ids.shape[-1])
    w = max(window or 0, 0)
    got = kernels.sdpa_mask(doc, w, dtype, BLOCK_Q=8, BLOCK_K=4, num_warps=4)
    testing.assert_same(got, reference.sdpa_mask(doc, w, dtype))
