"""Differential testing: run the Triton and torch backends on the same inputs and report the first mismatch.

Public so users can fuzz their own kernels the way fastft's property tests and ``python -m fastft check`` do:

    from fastft.testing import assert_same, differential
    differential(lambda backend: my_op(x, backend=backend))      # triton vs torch, exact
    assert_same(mine, reference, atol=1e-2, rtol=1e-2)           # any nesting of tensors/ints/lists/dicts

Random inputs come from a ``torch.Generator`` (``random_*``) or, for hypothesis, from the ``*_strategy``
functions (hypothesis is imported only when one is called).
"""

from __future__ import annotations

import dataclasses
import math

import torch

import fastft

# ---- comparison ------------------------------------------------------------------------------------------


def _first_mismatch(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float):
    if a.is_floating_point() or b.is_floating_point():
        same = torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=False)
    else:
        same = a == b
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in torch.nonzero(~same)[0])
    return index, a[index].item(), b[index].item(), int((~same).sum())


def assert_same(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, path: str = "output") -> None:
    """Raise ``AssertionError`` naming the first differing element of two nested results.

    Tensors must agree in shape and dtype, integers and bools exactly, floats within ``atol + rtol*|expected|``
    (NaN never matches). Lists, tuples, dicts and dataclasses are compared field by field.
    """
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise AssertionError(f"{path}: expected a tensor, got {type(actual).__name__}")
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(
                f"{path}: shape/dtype {tuple(actual.shape)}/{actual.dtype} != {tuple(expected.shape)}/{expected.dtype}"
            )
        bad = _first_mismatch(actual.detach().cpu(), expected.detach().cpu(), atol, rtol)
        if bad is not None:
            index, x, y, count = bad
            raise AssertionError(f"{path}[{', '.join(map(str, index))}]: {x} != {y} ({count} elements differ)")
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_same(getattr(actual, f.name), getattr(expected, f.name), atol=atol, rtol=rtol, path=f"{path}.{f.name}")
    elif isinstance(expected, dict):
        if set(actual) != set(expected):
            raise AssertionError(f"{path}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}")
        for k in expected:
            assert_same(actual[k], expected[k], atol=atol, rtol=rtol, path=f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        if len(actual) != len(expected):
            raise AssertionError(f"{path}: length {len(actual)} != {len(expected)}")
        for i, (x, y) in enumerate(zip(actual, expected)):
            assert_same(x, y, atol=atol, rtol=rtol, path=f"{path}[{i}]")
    elif isinstance(expected, float) and not (math.isclose(actual, expected, rel_tol=rtol, abs_tol=atol)):
        raise AssertionError(f"{path}: {actual} != {expected}")
    elif actual != expected:
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


def differential(fn, *, backends=("triton", "torch"), atol: float = 0.0, rtol: float = 0.0):
    """Run ``fn(backend=...)`` for each backend; assert every result equals the last one (the reference)."""
    results = {b: fn(backend=b) for b in backends}
    expected = results[backends[-1]]
    for b in backends[:-1]:
        assert_same(results[b], expected, atol=atol, rtol=rtol, path=f"{b} vs {backends[-1]}")
    return expected


# ---- random inputs ---------------------------------------------------------------------------------------


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """Uniform int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def random_seq_lengths(g: torch.Generator, num_tokens: int, max_len: int, zero_prob: float = 0.1) -> list[int]:
    """Lengths in [1, max_len] (some 0) that sum to at most ``num_tokens``."""
    lengths, total = [], 0
    while True:
        n = 0 if torch.rand((), generator=g) < zero_prob else _randint(g, 1, max_len)
        if total + n > num_tokens:
            return lengths
        lengths.append(n)
        total += n


def random_position_ids(
    g: torch.Generator, rows: int | None, tokens: int, max_doc_len: int, dtype=torch.int64
) -> torch.Tensor:
    """``[tokens]`` (rows=None) or ``[rows, tokens]`` position ids: documents of random lengths, most
    starting at 0, some at another offset (a continued document) or as runs of equal ids (padding)."""
    out = []
    for _ in range(rows or 1):
        row: list[int] = []
        while len(row) < tokens:
            length = _randint(g, 1, max_doc_len)
            kind = _randint(g, 0, 9)
            if kind == 0:
                row += [0] * length  # padding: every token is its own document
            else:
                first = 0 if kind > 2 else _randint(g, 1, 1000)
                row += range(first, first + length)
        out.append(row[:tokens])
    t = torch.tensor(out, dtype=dtype).reshape(rows or 1, tokens)
    return t if rows is not None else t[0]


# ---- packing: one differential case ----------------------------------------------------------------------


BLOCK_MASK_FIELDS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)


def packing_outputs(source: dict, *, windows=(None,), block_sizes=(128,), mask_dtypes=(torch.bool,), backend=None):
    """Everything ``packed_seq_info(**source)`` produces, as a dict of tensors/ints (for ``differential``)."""
    info = fastft.packed_seq_info(**source, backend=backend)
    out = {
        name: getattr(info, name)
        for name in ("cu_seqlens", "seq_lengths", "max_seqlen", "num_seqs", "doc_ids", "position_ids")
    }
    for w in windows:
        out[f"varlen_window_size[{w}]"] = info.varlen_kwargs(w)["window_size"]
        for dtype in mask_dtypes:
            out[f"sdpa_mask[{w},{dtype}]"] = info.sdpa_mask(w, dtype)
        if info.num_tokens:
            for bs in block_sizes:
                bm = info.flex_block_mask(w, bs)
                out[f"flex_block_mask[{w},{bs}]"] = {f: getattr(bm, f) for f in BLOCK_MASK_FIELDS}
    return out


def random_packing_case(g: torch.Generator, device, max_tokens: int) -> dict:
    """Keyword arguments for one random ``packing_outputs`` call."""
    tokens = _randint(g, 0, max_tokens)
    kind = _randint(g, 0, 2)
    if kind == 0:
        rows = None if _randint(g, 0, 1) else _randint(g, 1, 3)
        dtype = torch.int32 if _randint(g, 0, 1) else torch.int64
        pos = random_position_ids(g, rows, tokens, max(1, _randint(g, 1, max_tokens // 2)), dtype).to(device)
        source = {"position_ids": pos}
    else:
        lengths = random_seq_lengths(g, tokens, max(1, _randint(g, 1, max_tokens // 2)))
        extra = _randint(g, 0, 5)
        name = "seq_lengths" if kind == 1 else "cu_seqlens"
        values = lengths if kind == 1 else [sum(lengths[:i]) for i in range(len(lengths) + 1)]
        source = {name: values, "num_tokens": sum(lengths) + extra, "device": device}
    windows = (None, _randint(g, -1, 2), _randint(g, 1, max_tokens))
    block_sizes = (_randint(g, 1, 4) * 16, 2 ** _randint(g, 0, 3) if tokens <= 64 else 128)
    return dict(source=source, windows=windows, block_sizes=block_sizes, mask_dtypes=(torch.bool, torch.bfloat16))


def check_packing(g: torch.Generator, device, max_tokens: int) -> None:
    case = random_packing_case(g, device, max_tokens)
    try:
        differential(lambda backend: packing_outputs(**case, backend=backend))
    except AssertionError as e:
        raise AssertionError(f"{e}\ncase: {case}") from None


# op name -> fn(generator, device, max_tokens): one random differential case (``python -m fastft check``)
CHECKS = {"packing": check_packing}


# ---- hypothesis strategies -------------------------------------------------------------------------------


def seeds_strategy():
    """Seeds for a ``torch.Generator``: hypothesis draws the seed, the ``random_*`` helpers the data."""
    from hypothesis import strategies as st

    return st.integers(0, 2**63 - 1)


def position_ids_strategy(max_rows: int = 3, max_tokens: int = 256, dtypes=(torch.int32, torch.int64)):
    """``[T]`` or ``[B, T]`` CPU position ids with random documents (see ``random_position_ids``)."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        rows = draw(st.one_of(st.none(), st.integers(1, max_rows)))
        tokens = draw(st.integers(0, max_tokens))
        max_doc = draw(st.integers(1, max(1, max_tokens)))
        g = torch.Generator().manual_seed(draw(seeds_strategy()))
        return random_position_ids(g, rows, tokens, max_doc, draw(st.sampled_from(dtypes)))

    return build()


def seq_lengths_strategy(max_tokens: int = 256):
    """(lengths, num_tokens): lengths with zeros, and a token count at or past their sum."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        lengths = draw(st.lists(st.integers(0, max(1, max_tokens // 4)), max_size=12))
        return lengths, sum(lengths) + draw(st.integers(0, 8))

    return build()


def window_strategy(max_window: int = 300):
    from hypothesis import strategies as st

    return st.one_of(st.none(), st.integers(-2, max_window))
