"""fastft.testing, the kit users fuzz their own kernels with: comparisons, the seeded loop, random inputs."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given

from fastft import testing

# ---- assert_same and differential over backends ------------------------------------------------------------


def test_differential_reports_first_mismatch():
    with pytest.raises(AssertionError, match=r"triton vs torch\['x'\]\[2\]: 5 != 3"):
        testing.differential(lambda backend: {"x": torch.tensor([1, 2, 5 if backend == "triton" else 3])})
    with pytest.raises(AssertionError, match="shape/dtype"):
        testing.assert_same(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    testing.assert_same(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), atol=0.01)
    with pytest.raises(AssertionError, match=r"output\[0\]: nan != nan"):
        testing.assert_same(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    c = torch.tensor([1 + 2j, 3 - 1j])
    assert torch.equal(testing.bits(c.conj()), testing.bits(torch.tensor([1 - 2j, 3 + 1j])))  # the view's values
    testing.assert_same(torch.tensor([1 + 1j]), torch.tensor([1 + 1.0000001j]), atol=1e-3)  # complex: |difference|
    with pytest.raises(AssertionError, match="1 elements differ"):
        testing.assert_same(torch.tensor([1 + 1j]), torch.tensor([1 + 1.1j]), atol=1e-3)
    # Python floats: within atol + rtol * |expected|, NaN never, and a non-number is no match
    testing.assert_same({"loss": 1.0005, "n": 3}, {"loss": 1.0, "n": 3}, atol=0.01)
    testing.assert_same(2.02, 2.0, rtol=0.011)
    testing.assert_same(np.float32(0.5), 0.5)  # numpy scalars are numbers too
    with pytest.raises(AssertionError, match=r"output\['loss'\]: 1.05 != 1.0"):
        testing.assert_same({"loss": 1.05}, {"loss": 1.0}, atol=0.01)
    with pytest.raises(AssertionError, match="nan != nan"):
        testing.assert_same(float("nan"), float("nan"), atol=1.0)
    with pytest.raises(AssertionError, match="expected a number, got str"):
        testing.assert_same("1.0", 1.0, atol=1.0)


def test_differential_over_backends_returns_the_last_backends_result():
    calls = []

    def fn(backend):
        calls.append(backend)
        return torch.arange(3)

    assert torch.equal(testing.differential(fn, backends=("a", "b", "c")), torch.arange(3))
    assert calls == ["a", "b", "c"]
    with pytest.raises(AssertionError, match=r"a vs c\[1\]: 0 != 1"):
        testing.differential(lambda backend: torch.tensor([0, 1 - (backend == "a")]), backends=("a", "b", "c"))


# ---- two callables on fresh random inputs ------------------------------------------------------------------


def _inputs(g):
    n = testing.randint(g, 1, 50)
    return torch.randn(n, generator=g), float(torch.rand((), generator=g))


def _reference(x, alpha):
    return x * alpha


def _wrong_past_40(x, alpha):  # right on short inputs, one element wrong on long ones
    out = x * alpha
    if x.numel() > 40:
        out[40] += 1
    return out


def test_two_callables_agree_on_fresh_inputs(rng):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    got = testing.differential(lambda x, alpha: alpha * x, _reference, inputs=_inputs, cases=30, seed=seed)
    x, alpha = _inputs(torch.Generator().manual_seed(seed + 29))  # the last case's inputs
    assert torch.equal(got, x * alpha)


def test_a_failure_names_its_seed_and_the_first_differing_element_and_replays(rng):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    with pytest.raises(AssertionError) as failure:
        testing.differential(_wrong_past_40, _reference, inputs=_inputs, cases=200, seed=seed)
    message = str(failure.value)
    found = re.match(
        r"case (\d+) of 200, seed (\d+) \(replay it: cases=1, seed=\2\): candidate vs reference\[40\]: ", message
    )
    assert found, message
    case, case_seed = int(found[1]), int(found[2])
    assert case_seed == seed + case - 1 and _inputs(torch.Generator().manual_seed(case_seed))[0].numel() > 40
    for earlier in range(seed, case_seed):  # the cases before it passed: short inputs
        assert _inputs(torch.Generator().manual_seed(earlier))[0].numel() <= 40
    with pytest.raises(AssertionError) as replay:  # the printed seed alone fails the same way
        testing.differential(_wrong_past_40, _reference, inputs=_inputs, cases=1, seed=case_seed)
    assert str(replay.value).split(": ", 1)[1] == message.split(": ", 1)[1]


def test_each_callable_gets_its_own_copy_of_the_inputs():
    def in_place(x):
        return x.mul_(2)

    def inputs(g):
        return {"x": torch.ones(4, requires_grad=False)}

    with pytest.raises(AssertionError, match=r"candidate vs reference\[0\]: 2.0 != 1.0"):
        testing.differential(in_place, lambda x: x, inputs=inputs, cases=1, seed=0)  # the reference saw ones
    testing.differential(in_place, lambda x: 2 * x, inputs=inputs, cases=3, seed=0)  # keyword inputs: a dict
    testing.differential(lambda x: x + 1, lambda x: 1 + x, inputs=lambda g: torch.zeros(2), cases=2, seed=0)  # one


def test_two_callables_without_inputs_are_compared_once():
    assert testing.differential(lambda: [1, 2.0], lambda: [1, 2.0 + 1e-9], atol=1e-6) == [1, 2.0 + 1e-9]
    with pytest.raises(AssertionError, match=r"candidate vs reference\[1\]: 2.0 != 3.0"):
        testing.differential(lambda: [1, 2.0], lambda: [1, 3.0])


def test_backends_on_fresh_inputs():
    seen = []

    def fn(x, backend):
        seen.append((backend, x.numel()))
        return x * 2

    testing.differential(fn, inputs=lambda g: (torch.randn(testing.randint(g, 1, 9), generator=g),), cases=4, seed=7)
    assert [b for b, _ in seen] == ["triton", "torch"] * 4
    assert all(seen[2 * i][1] == seen[2 * i + 1][1] for i in range(4))  # both backends saw the same case


def test_differential_checks_its_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        testing.differential(3)
    with pytest.raises(TypeError, match="reference must be callable"):
        testing.differential(lambda: 1, 2)
    with pytest.raises(TypeError, match="inputs must be a callable"):
        testing.differential(lambda: 1, lambda: 1, inputs=[1])
    with pytest.raises(ValueError, match="backends"):
        testing.differential(lambda backend: 1, backends="torch")


# ---- fuzz: the seeded loop ---------------------------------------------------------------------------------


def test_fuzz_seeds_each_case_from_the_seed(rng):
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    draws = []
    testing.fuzz(lambda g: draws.append(torch.rand(3, generator=g)), cases=5, seed=seed)
    for i, d in enumerate(draws):
        assert torch.equal(d, torch.rand(3, generator=torch.Generator().manual_seed(seed + i)))


def test_fuzz_without_a_seed_draws_new_inputs_each_run():
    first, second = [], []
    testing.fuzz(lambda g: first.append(int(torch.randint(0, 2**62, (1,), generator=g))), cases=2)
    testing.fuzz(lambda g: second.append(int(torch.randint(0, 2**62, (1,), generator=g))), cases=2)
    assert first != second


def test_fuzz_names_the_seed_of_other_exceptions():
    def check(g):
        raise KeyError("boom")

    with pytest.raises(KeyError) as failure:
        testing.fuzz(check, cases=3, seed=11)
    if hasattr(failure.value, "add_note"):
        assert failure.value.__notes__ == ["case 1 of 3, seed 11 (replay it: cases=1, seed=11)"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(cases=0), ValueError, "cases must be an int >= 1"),
        (dict(cases=True), ValueError, "cases must be an int >= 1"),
        (dict(seed=-1), ValueError, "seed must be an int"),
        (dict(seed=1.5), ValueError, "seed must be an int"),
    ],
)
def test_fuzz_checks_its_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        testing.fuzz(lambda g: None, **kwargs)
    with pytest.raises(TypeError, match="check must be callable"):
        testing.fuzz(None, cases=1, seed=0)


# ---- random inputs and workloads ---------------------------------------------------------------------------


def test_random_inputs_keep_their_promises(rng):
    for _ in range(20):
        lengths = testing.random_seq_lengths(rng, 100, 30)
        assert sum(lengths) <= 100 and all(0 <= n <= 30 for n in lengths)
        pos = testing.random_position_ids(rng, 3, 40, 12, dtype=torch.int32)
        assert pos.shape == (3, 40) and pos.dtype == torch.int32 and (pos >= 0).all()
        assert testing.random_position_ids(rng, None, 17, 5).shape == (17,)
        ids = testing.random_topk_ids(rng, 9, 4, 8, strided=True)
        assert ids.shape == (9, 4) and not ids.is_contiguous()
        t = testing.random_strided_tensor(rng, "cpu", 64)
        assert t.dtype in testing.COPY_DTYPES and t.dim() <= 5
        b = testing.bits(t)
        assert not b.is_floating_point() and b.numel() * b.element_size() == t.numel() * t.element_size()
    pos = testing.packed_position_ids(64, 5, "cpu")
    assert pos.shape == (64,) and int((pos == 0).sum()) == 5
    assert testing.packed_position_ids(64, 5, "cpu", rows=2).shape == (2, 64)
    top = testing.router_ids(16, 8, 3, "cpu")
    assert top.shape == (16, 3) and all(len(set(row)) == 3 for row in top.tolist())


@given(testing.position_ids_strategy(max_rows=2, max_tokens=32), testing.seq_lengths_strategy(40))
def test_strategies_draw_what_they_say(position_ids, lengths_and_tokens):
    assert position_ids.dim() in (1, 2) and position_ids.dtype in (torch.int32, torch.int64)
    lengths, num_tokens = lengths_and_tokens
    assert num_tokens >= sum(lengths)


def test_no_host_sync_runs_the_body_without_cuda():
    ran = []
    with testing.no_host_sync():
        ran.append(1)
    assert ran == [1]


@pytest.mark.gpu
def test_no_host_sync_raises_on_a_sync():
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError), testing.no_host_sync():
        x.sum().item()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_tiny_hf_model(family):
    pytest.importorskip("transformers")
    model = testing.tiny_hf_model(family, seed=3)
    assert model.training and model.config.num_hidden_layers == 2
    ids = torch.randint(0, 128, (1, 8))
    assert model(input_ids=ids).logits.shape == (1, 8, 128)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_clear_of_router_ties_draws_until_no_token_is_near_a_tie(family, rng):
    pytest.importorskip("transformers")
    model = testing.tiny_hf_model(family, seed=int(torch.randint(1 << 30, (), generator=rng)))
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    assert len(routers) == 2
    draws = []

    def draw():
        draws.append(dict(input_ids=torch.randint(0, 128, (2, 16), generator=rng)))
        return draws[-1]

    margin = 1e-3
    batch = testing.clear_of_router_ties(model, draw, margin=margin)
    assert batch is draws[-1] and not any(r._forward_hooks for r in routers)
    with torch.no_grad():
        for router in routers:  # the chosen batch: every token's k-th expert clear of the next one
            gaps = []
            handle = router.register_forward_hook(lambda m, a, out: gaps.append(out[0].topk(m.top_k + 1).values))
            model(**batch)
            handle.remove()
            assert (gaps[0][..., -2] - gaps[0][..., -1]).min() > margin
    with torch.no_grad():  # every expert with one router row: every token ties, and no draw will do
        routers[1].weight.copy_(routers[1].weight[:1].clone().expand_as(routers[1].weight))
        if getattr(routers[1], "bias", None) is not None:
            routers[1].bias.fill_(0.0)
    with pytest.raises(ValueError, match="router tie"):
        testing.clear_of_router_ties(model, draw, tries=3)
    dense = testing.tiny_hf_model("llama")
    assert testing.clear_of_router_ties(dense, draw) is draws[-1]  # no router: the first batch
    for kwargs, error, match in [
        (dict(margin=-1e-4), ValueError, "margin must be >= 0, got -0.0001"),
        (dict(margin=float("nan")), ValueError, "margin must be finite, got nan"),
        (dict(margin="1e-4"), TypeError, "margin must be a number, got str"),
        (dict(tries=0), ValueError, "tries must be an int >= 1, got 0"),
        (dict(tries=2.0), TypeError, "tries must be an int, got float"),
        (dict(draw=draws[-1]), TypeError, "draw must be callable, got dict"),
        (dict(model=draws[-1]), TypeError, "model must be a torch.nn.Module, got dict"),
    ]:
        with pytest.raises(error, match=match):
            testing.clear_of_router_ties(**{"model": model, "draw": draw, **kwargs})


def test_differential_gives_each_callable_its_own_namedtuples_and_dataclasses():
    import collections
    import dataclasses

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass
    class Box:
        t: torch.Tensor

    def reference(pair, box):
        return pair.a + pair.b + box.t

    def candidate(pair, box):
        out = pair.a + pair.b + box.t
        box.t.mul_(2)  # written into: the reference must not see it
        pair.a.zero_()
        return out

    make = lambda g: (Pair(torch.randn(3, generator=g), torch.randn(3, generator=g)), Box(torch.randn(3, generator=g)))  # noqa: E731
    testing.differential(candidate, reference, inputs=make, cases=3)
