"""fastft.memory_plan: the plan is the least-time choice that fits (against brute force), and the cost model
is the one the module states."""

import dataclasses
import itertools
import math

import pytest
import torch

import fastft.memory_plan as mp
from fastft.memory_plan import LayerCost, plan_memory


def random_costs(g, n):
    costs = []
    for i in range(n):
        inp = int(torch.randint(1, 20, (), generator=g))
        sel = inp + int(torch.randint(0, 200, (), generator=g))
        keep = sel + int(torch.randint(1, 300, (), generator=g))
        f = float(torch.rand((), generator=g)) + 0.1
        s = float(torch.rand((), generator=g)) * f
        offloadable = bool(torch.rand((), generator=g) < 0.7)
        choices = mp.CHOICES if torch.rand((), generator=g) < 0.7 else (mp.KEEP, mp.RECOMPUTE, mp.OFFLOAD)
        costs.append(LayerCost(i, keep, sel, inp, offloadable, f, s, choices))
    return costs


def brute_force(costs, tokens, available):
    best = math.inf
    for combo in itertools.product(*(c.options() for c in costs)):
        extra = sum(c.bytes_for(ch, tokens) - c.bytes_for(c.floor, tokens) for c, ch in zip(costs, combo))
        if extra <= available:
            best = min(best, sum(c.seconds_for(ch, tokens) for c, ch in zip(costs, combo)))
    return best


def test_plan_is_the_least_time_that_fits(rng):
    for _ in range(30):
        costs = random_costs(rng, int(torch.randint(1, 5, (), generator=rng)))
        available = int(torch.randint(0, mp.RESOLUTION, (), generator=rng))  # bytes, so the knapsack is exact
        plan = plan_memory(costs, tokens=1, budget=1000 + available, floor_peak=1000)
        assert plan.peak <= plan.budget
        assert plan.seconds == pytest.approx(brute_force(costs, 1, available))
        for cost, line in zip(costs, plan.layers):
            assert line.choice in cost.options() and line.bytes == cost.bytes_for(line.choice, 1)
        assert plan.floor_seconds >= plan.seconds
    # a large budget: within rounding (each layer's bytes rounded up to one step of RESOLUTION) of the best
    costs = random_costs(rng, 4)
    plan = plan_memory(costs, tokens=1000, budget=10**9, floor_peak=10**6)
    assert plan.seconds == 0 and {line.choice for line in plan.layers} == {mp.KEEP}


def test_plan_below_the_floor_and_its_table():
    cost = LayerCost(0, 100.0, 40.0, 8.0, True, 1e-6, 5e-7)
    with pytest.raises(ValueError, match="below full recompute's expected peak"):
        plan_memory([cost], tokens=10, budget=99, floor_peak=100)
    plan = plan_memory([cost, dataclasses.replace(cost, layer=1)], tokens=10, budget=100 + 400 + 1000, floor_peak=100)
    assert plan.counts() == {"keep": 1, "selective": 1, "recompute": 0, "offload": 0}
    assert plan.choice(0) in ("keep", "selective") and plan.choice(5) is None
    text = str(plan)
    assert "memory plan for 10 tokens" in text and "keep" in text and "selective" in text
    assert len(text.splitlines()) == 4  # the head, the column names, one line per layer


def test_cost_model():
    cost = LayerCost(0, 100.0, 40.0, 8.0, True, 1.0, 0.5)
    assert [cost.bytes_for(c, 2) for c in mp.CHOICES] == [200, 80, 16, 0]
    assert [cost.seconds_for(c, 2) for c in mp.CHOICES] == [0.0, 1.0, 2.0, pytest.approx(2.02)]
    assert cost.seconds_for(mp.OFFLOAD, 2, host_bandwidth=1.0) == pytest.approx(16 + 0.02)  # the copy shows
    assert dataclasses.replace(cost, saved_s=1.0).seconds_for(mp.SELECTIVE, 2) == pytest.approx(0.1)  # f / 20
    local = dataclasses.replace(cost, offloadable=False)
    assert local.floor == mp.RECOMPUTE and mp.OFFLOAD not in local.options()
    assert dataclasses.replace(cost, choices=(mp.KEEP,)).options() == (mp.OFFLOAD, mp.KEEP)  # the floor stays


def test_check_choices():
    assert mp.check_choices([mp.KEEP, mp.OFFLOAD]) == (mp.KEEP, mp.OFFLOAD)
    with pytest.raises(TypeError, match="choices must be a sequence of strings"):
        mp.check_choices("keep")
    with pytest.raises(ValueError, match=r"choices must be among .*'fast'"):
        mp.check_choices([mp.KEEP, "fast"])


def test_format_bytes():
    assert [mp.format_bytes(n) for n in (512, 2048, 3 << 20, 3 << 29)] == ["512 B", "2.00 KiB", "3.00 MiB", "1.50 GiB"]
