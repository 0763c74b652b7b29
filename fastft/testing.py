"""Differential testing, for users fuzzing their own kernels the way fastft's property tests do: compare two
results and report the first mismatch, on fresh random inputs whose seed a failure prints; random inputs, a
no-host-sync context, tiny transformers models.

    from fastft.testing import assert_same, differential, fuzz
    differential(my_kernel, my_reference, inputs=make_inputs, cases=50)  # two callables, fresh inputs each case
    differential(lambda backend: my_op(x, backend=backend))              # triton vs torch, exact
    fuzz(check, cases=50)                                                # check(g) for fresh seeded generators
    assert_same(mine, reference, atol=1e-2, rtol=1e-2)                   # any nesting of tensors/ints/lists/dicts

Random inputs come from a ``torch.Generator`` (``random_*``) or, for hypothesis, from the ``*_strategy``
functions (hypothesis is imported only when one is called). fastft's own per-op checks are ``fastft.selfcheck``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import numbers
import os
import sys

import numpy as np
import torch

from ._checks import finite_arg, int_arg

__all__ = [
    "assert_same",
    "differential",
    "fuzz",
    "bits",
    "no_host_sync",
    "randint",
    "random_seq_lengths",
    "random_position_ids",
    "random_topk_ids",
    "random_strided_tensor",
    "COPY_DTYPES",
    "packed_position_ids",
    "router_ids",
    "tiny_hf_model",
    "clear_of_router_ties",
    "seeds_strategy",
    "position_ids_strategy",
    "seq_lengths_strategy",
    "window_strategy",
]

# ---- comparison ------------------------------------------------------------------------------------------


def _first_mismatch(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float):
    if a.is_complex() or b.is_complex():
        a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
        same = (a.to(torch.complex128) - b.to(torch.complex128)).abs() <= atol + rtol * b.to(torch.complex128).abs()
    elif a.is_floating_point() or b.is_floating_point():
        same = torch.isclose(a.double(), b.double(), atol=atol, rtol=rtol, equal_nan=False)
    else:
        same = a == b
    if bool(same.all()):
        return None
    index = tuple(int(i) for i in torch.nonzero(~same)[0])
    return index, a[index].item(), b[index].item(), int((~same).sum())


def assert_same(actual, expected, *, atol: float = 0.0, rtol: float = 0.0, path: str = "output") -> None:
    """Raise ``AssertionError`` naming the first differing element of two nested results.

    Tensors must agree in shape and dtype, integers and bools exactly, floats (and complex numbers, by the
    modulus of the difference) within ``atol + rtol*|expected|`` (NaN never matches). Lists, tuples, dicts
    and dataclasses are compared field by field.
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
            assert_same(
                getattr(actual, f.name), getattr(expected, f.name), atol=atol, rtol=rtol, path=f"{path}.{f.name}"
            )
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
    elif isinstance(expected, float):
        if isinstance(actual, (bool, np.bool_)) or not isinstance(actual, numbers.Real):
            raise AssertionError(f"{path}: expected a number, got {type(actual).__name__}")
        if not abs(actual - expected) <= atol + rtol * abs(expected):  # NaN never matches
            raise AssertionError(f"{path}: {actual} != {expected}")
    elif actual != expected:
        raise AssertionError(f"{path}: {actual!r} != {expected!r}")


def fuzz(check, *, cases: int = 20, seed: int | None = None) -> None:
    """Run ``check(g)`` ``cases`` times, each with a fresh ``torch.Generator`` (CPU) seeded ``seed + i``: a
    seeded loop for those without hypothesis. ``seed`` None draws one from the OS, so each run tries new
    inputs. A failing case names its seed: ``fuzz(check, cases=1, seed=S)`` replays it alone. An
    ``AssertionError`` is raised again with the seed in front of its message; another exception gets the seed
    as a note (printed to stderr on Python 3.10).
    """
    if isinstance(cases, bool) or not isinstance(cases, int) or cases < 1:
        raise ValueError(f"cases must be an int >= 1, got {cases!r}")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63 - cases:
        raise ValueError(f"seed must be an int in [0, 2**63 - cases), got {seed!r}")
    if not callable(check):
        raise TypeError(f"check must be callable, got {type(check).__name__}")
    for i in range(cases):
        case_seed = seed + i
        try:
            check(torch.Generator().manual_seed(case_seed))
        except Exception as e:
            where = f"case {i + 1} of {cases}, seed {case_seed} (replay it: cases=1, seed={case_seed})"
            if isinstance(e, AssertionError):
                raise AssertionError(f"{where}: {e}") from e
            if hasattr(e, "add_note"):
                e.add_note(where)
            else:
                print(where, file=sys.stderr)
            raise


def _fresh(value):
    """A copy of ``inputs``' result in which every tensor is cloned: each callable gets inputs of its own."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple):
        items = [_fresh(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # namedtuples too
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fresh = copy.copy(value)  # a dataclass's tensor fields cloned (init=False ones too)
        for field in dataclasses.fields(value):
            object.__setattr__(fresh, field.name, _fresh(getattr(value, field.name)))
        return fresh
    return value


def _call(fn, args, **extra):
    if isinstance(args, dict):
        return fn(**args, **extra)
    if isinstance(args, tuple):
        return fn(*args, **extra)
    return fn(args, **extra)


def differential(
    fn,
    reference=None,
    *,
    inputs=None,
    backends=("triton", "torch"),
    atol: float = 0.0,
    rtol: float = 0.0,
    cases: int = 20,
    seed: int | None = None,
):
    """Assert that two implementations agree; ``AssertionError`` naming the first element that differs.

    - ``differential(candidate, reference, inputs=make)``: for each of ``cases`` fresh seeded generators
      ``g`` (see ``fuzz``: a failure names its seed), ``args = make(g)`` (a tuple of positional arguments,
      a dict of keyword arguments, or one argument); ``candidate(*args)`` must equal ``reference(*args)``
      within ``atol + rtol * |reference|``. Each callable gets its own copy of the tensors.
    - ``differential(candidate, reference)``: ``candidate()`` against ``reference()``, once.
    - ``differential(fn, inputs=make)``: ``fn(*args, backend=b)`` for each of ``backends``, against the last.
    - ``differential(fn)``: ``fn(backend=b)`` for each of ``backends``, against the last.

    Results are compared by ``assert_same`` (nested tensors, numbers, lists, dicts, dataclasses). Returns the
    reference's result (of the last case).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if reference is not None and not callable(reference):
        raise TypeError(f"reference must be callable, got {type(reference).__name__}")
    if inputs is not None and not callable(inputs):
        raise TypeError(f"inputs must be a callable of a torch.Generator, got {type(inputs).__name__}")
    if reference is None and (isinstance(backends, str) or len(backends) < 1):
        raise ValueError(f"backends must be a sequence of backend names, got {backends!r}")

    def compare(args) -> object:
        if reference is not None:
            got = fn() if args is None else _call(fn, _fresh(args))
            expected = reference() if args is None else _call(reference, _fresh(args))
            assert_same(got, expected, atol=atol, rtol=rtol, path="candidate vs reference")
            return expected
        call = (lambda b: fn(backend=b)) if args is None else (lambda b: _call(fn, _fresh(args), backend=b))
        results = {b: call(b) for b in backends}
        expected = results[backends[-1]]
        for b in backends[:-1]:
            assert_same(results[b], expected, atol=atol, rtol=rtol, path=f"{b} vs {backends[-1]}")
        return expected

    if inputs is None:
        return compare(None)
    last = [None]

    def case(g: torch.Generator) -> None:
        last[0] = compare(inputs(g))

    fuzz(case, cases=cases, seed=seed)
    return last[0]


# ---- random inputs ---------------------------------------------------------------------------------------


def randint(g: torch.Generator, low: int, high: int) -> int:
    """Uniform int in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def random_seq_lengths(g: torch.Generator, num_tokens: int, max_len: int, zero_prob: float = 0.1) -> list[int]:
    """Lengths in [1, max_len] (some 0) that sum to at most ``num_tokens``."""
    lengths, total = [], 0
    while True:
        n = 0 if torch.rand((), generator=g) < zero_prob else randint(g, 1, max_len)
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
            length = randint(g, 1, max_doc_len)
            kind = randint(g, 0, 9)
            if kind == 0:
                row += [0] * length  # padding: every token is its own document
            else:
                first = 0 if kind > 2 else randint(g, 1, 1000)
                row += range(first, first + length)
        out.append(row[:tokens])
    t = torch.tensor(out, dtype=dtype).reshape(rows or 1, tokens)
    return t if rows is not None else t[0]


def random_topk_ids(
    g: torch.Generator,
    tokens: int,
    top_k: int,
    num_experts: int,
    *,
    unrouted: float = 0.1,
    dtype=torch.int64,
    strided: bool = False,
) -> torch.Tensor:
    """``[tokens, top_k]`` router ids: a few hot experts, duplicates within a row, and a fraction
    ``unrouted`` of out-of-range ids (-1, -7, num_experts, num_experts + 5). ``strided``: not contiguous."""
    hot = torch.randint(0, num_experts, (max(1, num_experts // 8),), generator=g)
    uniform = torch.randint(0, num_experts, (tokens, top_k), generator=g)
    skewed = hot[torch.randint(0, hot.numel(), (tokens, top_k), generator=g)]
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < 0.5, skewed, uniform)
    bad = torch.tensor([-1, -7, num_experts, num_experts + 5])[torch.randint(0, 4, (tokens, top_k), generator=g)]
    ids = torch.where(torch.rand(tokens, top_k, generator=g) < unrouted, bad, ids).to(dtype)
    if strided:
        return torch.stack([ids, -ids], dim=-1)[..., 0]  # strides (2 * top_k, 2)
    return ids


# ---- tensors of every dtype and layout -------------------------------------------------------------------

COPY_DTYPES = (
    torch.bool,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted as same-width integers: compares every dtype bit for bit (NaN payloads included)."""
    t = t.resolve_conj().resolve_neg()  # the values a lazy view reads, not its base's
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def random_strided_tensor(g: torch.Generator, device, max_numel: int, dtype=None) -> torch.Tensor:
    """A random view: rank 0-5, any of ``COPY_DTYPES``, random bits (floats include NaN/inf patterns),
    then permuted, sliced with steps and offsets, or expanded along a size-1 dimension."""
    dtype = dtype or COPY_DTYPES[randint(g, 0, len(COPY_DTYPES) - 1)]
    rank = randint(g, 0, 5)
    budget = max(1, max_numel)
    shape = []
    for _ in range(rank):
        shape.append(randint(g, 0 if randint(g, 0, 9) == 0 else 1, max(1, min(6, budget))))
        budget = max(1, budget // max(1, shape[-1]))
    steps = [randint(g, 1, 2) for _ in shape]
    base_shape = [z * st + randint(g, 0, 1) for z, st in zip(shape, steps)]
    if dtype == torch.bool:
        base = torch.randint(0, 2, base_shape, generator=g).bool()
    else:
        nbytes = math.prod(base_shape) * torch.empty((), dtype=dtype).element_size()
        base = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(base_shape)
    index = []
    for z, st, b in zip(shape, steps, base_shape):
        start = randint(g, 0, b - (z - 1) * st - 1) if z else 0
        index.append(slice(start, start + (z - 1) * st + 1 if z else start, st))
    t = base.to(device)[tuple(index)]
    if rank > 1 and randint(g, 0, 1):
        t = t.permute(*torch.randperm(rank, generator=g).tolist())
    ones = [i for i, z in enumerate(t.shape) if z == 1]
    if ones and randint(g, 0, 3) == 0:
        shape = list(t.shape)
        shape[ones[0]] = randint(g, 2, 4)
        t = t.expand(shape)
    return t


# ---- workloads of fixed seed -----------------------------------------------------------------------------


def packed_position_ids(num_tokens: int, num_docs: int, device, rows: int | None = None) -> torch.Tensor:
    """Position ids of ``num_docs`` documents of random lengths (fixed seed) filling ``num_tokens``; ``[T]``,
    or the same row repeated ``[rows, T]``."""
    g = torch.Generator().manual_seed(num_tokens * 31 + num_docs)
    cuts = torch.randperm(num_tokens - 1, generator=g)[: num_docs - 1].add(1).sort().values
    cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([num_tokens])])
    pos = torch.arange(num_tokens) - torch.repeat_interleave(cu[:-1], cu.diff())
    return pos.to(device) if rows is None else pos.expand(rows, -1).contiguous().to(device)


def router_ids(tokens: int, experts: int, top_k: int, device, seed: int = 0) -> torch.Tensor:
    """Top-k of random router logits: K distinct experts per token, as a real router gives."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices


@contextlib.contextmanager
def no_host_sync():
    """Inside it, any CUDA call that makes the host wait for the GPU raises (``set_sync_debug_mode("error")``);
    pending work is synchronized first. Without CUDA it only runs the body."""
    if not torch.cuda.is_available():
        yield
        return
    for index in range(torch.cuda.device_count()):  # every GPU's pending work, not only the current one's
        torch.cuda.synchronize(index)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


_TINY_FAMILIES = {
    "llama": ("LlamaConfig", dict(intermediate_size=64)),
    "qwen3": (
        "Qwen3Config",
        dict(
            intermediate_size=64,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            use_sliding_window=True,
            max_window_layers=0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            moe_intermediate_size=32,
            intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_local_experts=5,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
        ),
    ),
}


def tiny_hf_model(family: str, dtype=torch.float32, device="cpu", seed: int = 0, **fields):
    """A tiny transformers causal LM (``llama``, ``qwen3`` (a sliding-window layer), ``qwen3_moe``, ``gpt_oss``)
    with random weights (``seed``; biases drawn too, so that gpt-oss's zero-initialised expert biases matter),
    in train mode; ``fields`` override the config (2 layers, hidden 64, 4 heads, 2 kv heads, vocab 128)."""
    import transformers

    config_cls, family_fields = _TINY_FAMILIES[family]
    common = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    config = getattr(transformers, config_cls)(**{**common, **family_fields, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.05)
    return model.train()


def clear_of_router_ties(model: torch.nn.Module, draw, margin: float = 1e-4, tries: int = 100) -> dict:
    """The first of ``draw()``'s batches (a dict of the model's inputs) on which every MoE router of ``model`` keeps
    its top-k experts' logits more than ``margin`` above the next expert's, for every token (a model without
    routers: the first batch). Two fp32 implementations of one model differ by rounding (about 1e-7 in the
    logits): on a near-tied token that flips an expert choice, and the outputs then differ by far more than any
    tolerance. A router is a module with an integer ``top_k`` and a ``weight`` of one row per expert (or such a
    block's ``router`` / ``gate`` linear layer); its logits are the output of that width. ``TypeError`` for a
    ``model`` that is not a module, a ``draw`` that is not callable, a ``margin`` that is not a number or
    ``tries`` not an int; ``ValueError`` for a ``margin`` negative or not finite, ``tries`` below 1, or when no
    draw is clear."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(draw):
        raise TypeError(f"draw must be callable, got {type(draw).__name__}")
    margin = finite_arg("margin", margin)
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    tries = int_arg("tries", tries, minimum=1)
    taps = []
    for module in model.modules():
        top_k = getattr(module, "top_k", None)
        if not isinstance(top_k, int) or isinstance(top_k, bool):
            continue
        linear = module if hasattr(module, "weight") else getattr(module, "router", getattr(module, "gate", None))
        if isinstance(getattr(linear, "weight", None), torch.Tensor):
            taps.append((linear, top_k))
    gaps = []

    def tap(top_k):
        def record(module, args, output):
            experts = module.weight.shape[0]
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            logits = next(o for o in outputs if torch.is_tensor(o) and o.is_floating_point() and o.shape[-1] == experts)
            top = logits.detach().float().topk(top_k + 1, dim=-1).values
            gaps.append((top[..., -2] - top[..., -1]).min().item())

        return record

    hooks = [linear.register_forward_hook(tap(top_k)) for linear, top_k in taps]
    try:
        for _ in range(tries):
            batch, gaps[:] = draw(), []
            if not hooks:
                return batch
            with torch.no_grad():
                model(**batch)
            if min(gaps) > margin:
                return batch
    finally:
        for h in hooks:
            h.remove()
    raise ValueError(f"draw: {tries} batches all came within {margin} of a router tie")


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
