"""fastft.memory_plan and apply(model, memory_budget=...): the plan is the least-time choice that fits (against
brute force), and a model trained under any plan (budgets forcing keep, selective, recompute, offload, mixes)
computes the losses and gradients of full recompute, bit for bit on CPU.

On CPU there is no device memory to read: the tests hand the planner a fake (``FakeMemory``: what the model
holds and the first step's peak), a clock (``FakeClock``: fixed times, so that the time model decides the
same way every run) and ``offloadable`` (the floor offloads, as on a GPU; on CPU the offloaded checkpoint
recomputes). The activation bytes are measured for real (saved-tensor hooks work on CPU)."""

import itertools
import math

import pytest
import torch

import fastft.memory_plan as mp
from fastft.memory_plan import LayerCost, MemoryPlanner, plan_memory

transformers = pytest.importorskip("transformers")

import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

HELD, ABOVE = 10_000, 50_000  # the fake device: bytes the model holds, and the first step's peak above them


class FakeMemory:
    def __init__(self, held=HELD, above=ABOVE, reachable=1 << 40, total=1 << 40):
        self.held, self.above, self.reachable, self.total = held, above, reachable, total
        self.resets = 0

    def allocated(self):
        return self.held

    def peak(self):
        return self.held + self.above

    def reset_peak(self):
        self.resets += 1

    def capacity(self):
        return self.reachable, self.total


class FakeClock:
    """Every layer forward takes 1 s and every op selective saves 0.1 s: selective costs 1/20 of a forward."""

    def start(self, device, label):
        return label

    def stop(self, token):
        return token

    def seconds(self, span):
        return {"forward": 1.0, "saved_op": 0.1}[span]


def planner(budget, **kwargs):
    kwargs = {"device_memory": FakeMemory(), "clock": FakeClock(), "offloadable": lambda x: True, **kwargs}
    return MemoryPlanner(budget, **kwargs)


# ---- planning from numbers ----------------------------------------------------------------------------------


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
    plan = plan_memory([cost, dataclass_replace(cost, layer=1)], tokens=10, budget=100 + 400 + 1000, floor_peak=100)
    assert plan.counts() == {"keep": 1, "selective": 1, "recompute": 0, "offload": 0}
    assert plan.choice(0) in ("keep", "selective") and plan.choice(5) is None
    text = str(plan)
    assert "memory plan for 10 tokens" in text and "keep" in text and "selective" in text
    assert len(text.splitlines()) == 4  # the head, the column names, one line per layer


def dataclass_replace(obj, **fields):
    import dataclasses

    return dataclasses.replace(obj, **fields)


def test_cost_model():
    cost = LayerCost(0, 100.0, 40.0, 8.0, True, 1.0, 0.5)
    assert [cost.bytes_for(c, 2) for c in mp.CHOICES] == [200, 80, 16, 0]
    assert [cost.seconds_for(c, 2) for c in mp.CHOICES] == [0.0, 1.0, 2.0, pytest.approx(2.02)]
    assert cost.seconds_for(mp.OFFLOAD, 2, host_bandwidth=1.0) == pytest.approx(16 + 0.02)  # the copy shows
    assert dataclass_replace(cost, saved_s=1.0).seconds_for(mp.SELECTIVE, 2) == pytest.approx(0.1)  # f / 20
    local = dataclass_replace(cost, offloadable=False)
    assert local.floor == mp.RECOMPUTE and mp.OFFLOAD not in local.options()
    assert dataclass_replace(cost, choices=(mp.KEEP,)).options() == (mp.OFFLOAD, mp.KEEP)  # the floor stays


@pytest.mark.parametrize(
    "value, error, match",
    [
        (0, ValueError, "positive number of bytes"),
        (-5, ValueError, "positive number of bytes"),
        (1.5, ValueError, "fraction of the device's memory"),
        (0.0, ValueError, "fraction of the device's memory"),
        (float("nan"), ValueError, "fraction"),
        ("lots", ValueError, "'auto'"),
        (True, TypeError, "memory_budget must be"),
        ([1], TypeError, "memory_budget must be"),
    ],
)
def test_bad_budgets(value, error, match):
    with pytest.raises(error, match=match):
        mp.check_memory_budget(value)
    with pytest.raises(error, match=match):
        MemoryPlanner(value)
    with pytest.raises(error, match=match):
        ft_hf.apply(tiny_hf_model("llama"), memory_budget=value)


def test_budget_forms():
    memory = FakeMemory(reachable=50 << 30, total=80 << 30)
    assert MemoryPlanner(123).resolve_budget(memory) == 123
    assert MemoryPlanner(0.5).resolve_budget(memory) == 40 << 30
    assert MemoryPlanner("auto").resolve_budget(memory) == int((50 << 30) - 0.08 * (80 << 30))
    small = FakeMemory(reachable=5 << 30, total=8 << 30)
    assert MemoryPlanner("auto").resolve_budget(small) == 4 << 30  # at least 1 GiB kept free
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        MemoryPlanner("auto", max_tokens=1.5)
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        MemoryPlanner("auto", max_tokens=0)


def test_saved_ops():
    mm, addmm_, add_ = torch.ops.aten.mm.default, torch.ops.aten.addmm_.default, torch.ops.aten.add_.Tensor
    x, w, thin = torch.empty(10, 64), torch.empty(64, 32), torch.empty(10, 4)
    assert mp.saved_by_selective(mm, (x, w))
    assert not mp.saved_by_selective(mm, (thin, torch.empty(4, 64)))  # LoRA's up projection: 4 < 64 / 8
    assert mp.saved_by_selective(mm, (thin, torch.empty(4, 32)))
    assert mp.saved_by_selective(addmm_, (torch.empty(10, 32), x, w))  # an in-place GEMM
    assert not mp.saved_by_selective(add_, (x, x))  # any other in-place op
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    q = torch.empty(1, 2, 8, 16)
    assert mp.saved_by_selective(flash, (q, q, q))
    assert not mp.saved_by_selective(flash, (q, q, q, 0.1))  # dropout: recomputed with its random numbers
    assert not mp.saved_by_selective(flash, (q, q, q), {"dropout_p": 0.1})


# ---- the integration --------------------------------------------------------------------------------------

LAYERS, TOKENS = 3, 48


@pytest.fixture(autouse=True)
def torch_ops(monkeypatch):
    monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the ops' CPU path (the interpreter is not what is tested)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: threads only contend (tens of times slower on a busy host)
    yield
    torch.set_num_threads(threads)


def build(lora=False, family="llama", **fields):
    model = tiny_hf_model(family, num_hidden_layers=LAYERS, **fields)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
        with torch.no_grad():  # non-zero B, so that every adapter's gradient flows through the layers
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
    return model


def batches(steps=3, tokens=TOKENS, seed=0):
    """Fresh packed rows: documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in [tokens] * steps if isinstance(tokens, int) else tokens:
        ids = torch.randint(0, 128, (1, n), generator=g)
        cut = sorted(torch.randperm(n - 1, generator=g)[:3].add(1).tolist())
        pos = torch.cat([torch.arange(b - a) for a, b in zip([0, *cut], [*cut, n])])[None]
        out.append(dict(input_ids=ids, labels=ids, position_ids=pos))
    return out


def train(model, rows):
    """Losses and gradients of SGD steps on ``rows``."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    results = []
    for row in rows:
        opt.zero_grad(set_to_none=True)
        loss = model(**row).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        opt.step()
    return results


def assert_equal(got, want):
    assert len(got) == len(want)
    for (loss, grads), (loss2, grads2) in zip(got, want):
        assert torch.equal(loss, loss2), (loss, loss2)
        assert grads.keys() == grads2.keys() and grads
        for name in grads:
            assert torch.equal(grads[name], grads2[name]), name


def measured(lora, **build_fields):
    """The costs the planner measures on the model (a huge budget), and its floor's expected peak."""
    model = build(lora, **build_fields)
    p = planner(1 << 40)
    ft_hf.apply(model, memory_budget=p)
    train(model, batches(2))
    assert p.plan is not None and len(p.costs) == LAYERS
    return p.costs, p.plan.floor_peak


def extra(costs, choice):
    return sum(c.bytes_for(choice, TOKENS) - c.bytes_for(c.floor, TOKENS) for c in costs)


@pytest.mark.parametrize("lora", [False, True])
def test_budgets_force_each_choice_with_full_recompute_results(lora):
    reference = build(lora)
    ft_hf.apply(reference)  # fastft's checkpointing, every layer: full recompute
    rows = batches(4)
    want = train(reference, rows)
    costs, floor_peak = measured(lora)
    assert floor_peak == HELD + ABOVE
    c = costs[0]
    assert c.input_bytes == 64 * 4 and c.offloadable  # hidden 64, fp32
    assert c.input_bytes < c.selective_bytes < c.keep_bytes
    slack = (extra(costs, mp.SELECTIVE) + 1) // 100  # the knapsack's rounding; less than any other upgrade
    keep_one = c.bytes_for(mp.KEEP, TOKENS) - c.bytes_for(mp.SELECTIVE, TOKENS)
    cases = {
        "keep": (1 << 40, {"keep": LAYERS}),
        "selective": (floor_peak + extra(costs, mp.SELECTIVE) + slack, {"selective": LAYERS}),
        "recompute": (floor_peak + extra(costs, mp.RECOMPUTE) + slack, {"recompute": LAYERS}),
        "offload": (floor_peak, {"offload": LAYERS}),
        "mixed": (floor_peak + extra(costs, mp.SELECTIVE) + keep_one + slack, {"keep": 1, "selective": LAYERS - 1}),
    }
    for name, (budget, counts) in cases.items():
        model = build(lora)
        p = planner(budget)
        ft_hf.apply(model, memory_budget=p)
        got = train(model, rows)
        assert p.plan.counts() == {**dict.fromkeys(mp.CHOICES, 0), **counts}, (name, str(p.plan))
        assert p.plan.peak <= budget
        assert_equal(got, want)


def test_measured_bytes_are_what_the_layer_saves():
    """The keep bytes equal what an uncheckpointed layer saves for backward (its parameters aside), counted
    here from the layer's own forward."""
    costs, _ = measured(False)
    model = ft_hf.apply(build(False), offload_checkpointing=False)
    layer = ft_hf.decoder_layers(model)[1]
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages, inside = {}, [False]

    def pack(t):
        if inside[0] and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batches(1)[0])
    assert storages and costs[1].keep_bytes * TOKENS == sum(storages.values())


def test_dropout_and_in_place_writes_keep_results_exact():
    """Attention dropout (its random numbers) and a GEMM result written into in place (seen by autograd, and
    behind its back as a kernel writes) are recomputed, not saved: selective still computes what full
    recompute does."""
    rows = batches(3)

    def patched(attention_dropout):
        model = build(False, attention_dropout=attention_dropout)
        for layer in ft_hf.decoder_layers(model):
            mlp = layer.mlp
            forward = mlp.forward

            def scaled(x, forward=forward):
                y = forward(x)  # down_proj's GEMM result: written into below
                y.mul_(0.5)
                y.data.add_(0.25)  # not seen by autograd (a kernel writing in place)
                return y

            mlp.forward = scaled
        return model

    reference = patched(0.3)
    ft_hf.apply(reference)
    want = train(reference, rows)
    model = patched(0.3)
    p = planner(1 << 40, choices=(mp.SELECTIVE,))  # selective wherever it fits: everywhere
    ft_hf.apply(model, memory_budget=p)
    got = train(model, rows)
    assert p.plan.counts()["selective"] == LAYERS
    assert_equal(got, want)
