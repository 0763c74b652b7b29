"""fastft.memory_planner and apply(model, memory_budget=...): budgets and their errors, and a model trained under
any plan (budgets forcing keep, selective, recompute, offload, mixes) computes the losses and gradients of
full recompute, bit for bit on CPU.

On CPU there is no device memory to read: the tests hand the planner a fake (``FakeMemory``: what the model
holds and the first step's peak), a clock (``FakeClock``: fixed times, so that the time model decides the
same way every run) and ``offloadable`` (the floor offloads, as on a GPU; on CPU the offloaded checkpoint
recomputes). The activation bytes are measured for real (saved-tensor hooks work on CPU)."""

import gc

import pytest
import torch

import fastft.memory_measure as mm
import fastft.memory_plan as mp
from fastft.memory_planner import MemoryPlanner

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
    assert c.input_bytes == mm.allocated_bytes(TOKENS * 64 * 4) / TOKENS and c.offloadable  # hidden 64, fp32
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
            storages[t.untyped_storage().data_ptr()] = mm.allocated_bytes(t.untyped_storage().nbytes())
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


def test_max_tokens_and_larger_steps():
    """The plan is made for max_tokens; without it for the largest step seen, and again for a larger one."""
    costs, floor_peak = measured(False)
    budget = floor_peak + 2 * extra(costs, mp.KEEP)  # every layer keeps at TOKENS, not at 3 * TOKENS
    model = build(False)
    p = planner(budget, max_tokens=3 * TOKENS)
    ft_hf.apply(model, memory_budget=p)
    train(model, batches(2))
    assert p.plan.tokens == 3 * TOKENS and p.plan.counts()["keep"] < LAYERS
    assert p.plan.floor_peak == HELD + 3 * ABOVE  # the first step's peak above what was held, per token
    model = build(False)
    p = planner(budget)
    ft_hf.apply(model, memory_budget=p)
    rows = batches(tokens=[TOKENS, TOKENS, TOKENS // 2, 3 * TOKENS])
    want = train(ft_hf.apply(build(False)), rows)
    got = train(model, rows[:3])
    assert p.plan.tokens == TOKENS and p.plan.counts()["keep"] == LAYERS  # a smaller step keeps the plan
    got += train(model, rows[3:])
    assert p.plan.tokens == 3 * TOKENS and p.plan.counts()["keep"] < LAYERS and p.plan.peak <= budget
    assert_equal(got[:3], want[:3])  # (the optimizers differ after the first: separate SGD states)
    assert p.plan_for(TOKENS).counts()["keep"] == LAYERS


def test_budget_below_full_recompute():
    model = build(False)
    ft_hf.apply(model, memory_budget=planner(HELD + ABOVE - 1))
    rows = batches(2)
    train(model, rows[:1])  # the first step runs at the floor, measured
    with pytest.raises(ValueError, match=r"memory_budget=59999 \(58\.59 KiB\) is below what full recompute needs"):
        train(model, rows[1:])
    refused = build(False)
    hooks = dict(refused.model._forward_pre_hooks), dict(refused.model._forward_hooks)
    with pytest.raises(ValueError, match="is not above the 9.77 KiB the model already holds"):
        ft_hf.apply(refused, memory_budget=planner(HELD))  # before the first step
    # refused part way: the model is as it was (apply undid what it had changed)
    assert refused.config._attn_implementation == "sdpa" and "_fastft_state" not in refused.__dict__
    assert (dict(refused.model._forward_pre_hooks), dict(refused.model._forward_hooks)) == hooks
    assert not any(getattr(m, "gradient_checkpointing", False) for m in refused.modules())
    model = build(False)
    ft_hf.apply(model, memory_budget=planner(HELD + ABOVE))  # the floor fits at TOKENS, not at twice as many
    train(model, batches(2))
    with pytest.warns(RuntimeWarning, match="a step of 96 tokens needs more than memory_budget=60000"):
        train(model, batches(1, 2 * TOKENS))
    assert ft_hf.memory_plan(model).counts()["offload"] == LAYERS
    auto = planner("auto", device_memory=FakeMemory(reachable=HELD, total=HELD))  # less than the floor: the floor
    model = ft_hf.apply(build(False), memory_budget=auto)
    train(model, batches(2))
    assert auto.plan.counts()["offload"] == LAYERS


def test_needs_a_cuda_device_or_its_memory():
    model = ft_hf.apply(build(False), memory_budget="auto")
    with pytest.raises(ValueError, match="memory_budget plans CUDA device memory; this model runs on cpu"):
        train(model, batches(1))


def test_apply_arguments():
    with pytest.raises(ValueError, match="needs offload_checkpointing=True"):
        ft_hf.apply(build(False), memory_budget="auto", offload_checkpointing=False)
    with pytest.raises(ValueError, match="give memory_budget too"):
        ft_hf.apply(build(False), max_tokens=100)
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        ft_hf.apply(build(False), memory_budget="auto", max_tokens="100")
    with pytest.raises(ValueError, match="not beside it"):
        ft_hf.apply(build(False), memory_budget=planner("auto"), max_tokens=100)
    with pytest.raises(ValueError, match="choices must be among"):
        planner("auto", choices=("keep", "fast"))
    with pytest.raises(ValueError, match="apply the model with offload_checkpointing=True"):
        ft_hf.use_memory_plan(build(False), "auto")


def test_only_training_steps_are_planned_and_revert():
    """Evaluation, no-grad and generation forwards neither start a step nor checkpoint; the first step spans
    every training forward before its backward; revert removes the planner."""
    model = build(False)
    p = planner(1 << 40)
    ft_hf.apply(model, memory_budget=p)
    assert ft_hf.memory_plan(model) is None
    row = batches(1)[0]
    model.eval()
    with torch.no_grad():
        model(**row)
    model.generate(row["input_ids"][:, :5], max_new_tokens=3, do_sample=False)
    model.train()
    with torch.no_grad():
        model(**row)
    assert p.memory_budget == 1 << 40 and p.device_memory.resets == 0  # no step started
    model(**row)  # a training forward without backward: the first step goes on
    train(model, batches(1))
    assert p.device_memory.resets == 1 and ft_hf.memory_plan(model) is None
    train(model, batches(1))  # the first forward after a backward makes the plan
    assert ft_hf.memory_plan(model) is p.plan and p.plan.counts()["keep"] == LAYERS
    ft_hf.revert(model)
    assert ft_hf.memory_planner(model) is None
    assert not any(layer.gradient_checkpointing for layer in ft_hf.decoder_layers(model))


def _graph_tensors() -> int:
    """Tensors alive in this process that belong to an autograd graph."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("choice", mp.CHOICES)
def test_no_step_leaves_a_graph_behind(lora, choice):
    """The measurement forwards' graphs are freed with their results (a saved-tensor hook that kept an op's own
    output made a cycle, node -> output -> node, that held every layer's activations for good: a third of an
    80 GB GPU at Qwen3-8B widths, 36 layers), and so are the graphs of each choice's steps."""
    before = _graph_tensors()
    model = build(lora)
    ft_hf.apply(model, memory_budget=planner(1 << 40, choices=(choice,)))
    train(model, batches(1))  # the measured step
    assert _graph_tensors() == before
    train(model, batches(2))  # planned
    assert ft_hf.memory_plan(model).counts()[choice] == LAYERS and _graph_tensors() == before


@pytest.mark.parametrize("spelling", ["gradient_checkpointing_enable", "activation_checkpointing_enable"])
def test_checkpointing_enabled_again(spelling):
    """transformers' every_n_layers (Trainer, TRL) picks the layers the plan covers; turning checkpointing
    on again measures again. A context_fn among the options leaves selective out."""
    model = build(False)
    if not hasattr(model, spelling):
        pytest.skip(f"transformers {transformers.__version__} has no {spelling}")
    p = planner(1 << 40)
    ft_hf.apply(model, memory_budget=p)
    train(model, batches(2))
    assert p.plan is not None
    getattr(model, spelling)(every_n_layers=2)
    assert p.plan is None
    train(model, batches(2))
    assert [line.layer for line in p.plan.layers] == [0, 2]
    getattr(model, spelling)({"context_fn": torch.utils.checkpoint.noop_context_fn})
    train(model, batches(2))
    assert all(mp.SELECTIVE not in c.choices for c in p.costs) and len(p.costs) == LAYERS


def test_graphs_plan_no_selective():
    model = build(False)
    p = planner(1 << 40, choices=(mp.SELECTIVE, mp.RECOMPUTE))
    ft_hf.apply(model, memory_budget=p, graphs=True)
    rows = batches(3)
    want = train(ft_hf.apply(build(False)), rows)
    assert_equal(train(model, rows), want)
    assert p.plan.counts()["recompute"] == LAYERS  # selective would fit, but a graph cannot replay it


def test_trainer_with_a_plan(tmp_path):
    pytest.importorskip("accelerate")
    model = build(True)
    p = planner(1 << 40)
    ft_hf.apply(model, memory_budget=p)
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 128, (n,), generator=g).tolist()} for n in (5, 9, 3, 7, 6, 8)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_checkpointing=True,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    collate = transformers.DataCollatorWithFlattening()
    transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
    assert p.plan is not None and p.plan.counts()["keep"] == LAYERS


HYBRID = dict(  # Qwen3-Next: Gated DeltaNet and attention layers, MoE experts
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
)


def build_other(family):
    if family == "qwen3_next":
        config = transformers.AutoConfig.for_model("qwen3_next", **HYBRID)
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config).train()
    peft = pytest.importorskip("peft")
    model = tiny_hf_model("qwen3_moe", num_hidden_layers=LAYERS)
    targets = ["q_proj", "v_proj"]  # and LoRA on the experts' weights, through fastft's experts path
    config = peft.LoraConfig(r=4, target_modules=targets, target_parameters=["mlp.experts.gate_up_proj"])
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_moe_and_hybrid_models(family):
    rows = batches(3)
    want = train(ft_hf.apply(build_other(family)), rows)
    for choices in [(mp.KEEP,), (mp.SELECTIVE,)]:
        model = build_other(family)
        p = planner(1 << 40, choices=choices)
        ft_hf.apply(model, memory_budget=p)
        assert_equal(train(model, rows), want)
        assert p.plan.counts()[choices[0]] == LAYERS


WRAPS = (("ddp", False), ("ddp static", True), ("fsdp2", True))


def distributed_worker(rank, world, init, out):
    import torch.distributed as dist

    from fastft.spawn import exit_spawned_worker

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        import os

        os.environ["FASTFT_BACKEND"] = "torch"
        torch.set_num_threads(1)
        results = {}
        for wrap, lora in WRAPS:
            model = build(lora)
            # rank 1 can reach less memory: every rank plans for it
            reachable = 1 << 40 if rank == 0 else (1 << 30) + 360_000
            p = planner("auto", device_memory=FakeMemory(reachable=reachable, total=1 << 30))
            ft_hf.apply(model, memory_budget=p)
            if wrap.startswith("ddp"):
                wrapped = torch.nn.parallel.DistributedDataParallel(model, static_graph=wrap == "ddp static")
            else:
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = init_device_mesh("cpu", (world,))  # gloo on CPU tensors, also where a GPU is present
                for layer in ft_hf.decoder_layers(model):
                    fully_shard(layer, mesh=mesh)
                wrapped = fully_shard(model, mesh=mesh)
            got = []
            for row in batches(3):  # every rank the same rows: the gradients are one process's
                model.zero_grad(set_to_none=True)
                loss = wrapped(**row).loss
                loss.backward()
                grads = {
                    n: (q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad).detach().clone()
                    for n, q in model.named_parameters()
                    if q.grad is not None
                }
                got.append((loss.detach(), grads))
            results[wrap] = (str(p.plan), got)
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    exit_spawned_worker()


@pytest.mark.distributed
def test_ranks_agree_on_one_plan_under_ddp_and_fsdp2(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as multiprocessing

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    out = str(tmp_path / "out")
    multiprocessing.spawn(distributed_worker, args=(2, str(tmp_path / "init"), out), nprocs=2)
    results = [torch.load(f"{out}.{r}") for r in range(2)]
    for wrap, lora in WRAPS:
        plans = [r[wrap][0] for r in results]
        assert plans[0] == plans[1]
        assert plans[0].count("selective") == LAYERS, plans[0]  # rank 1's budget, on both ranks
        reference = build(lora)
        ft_hf.apply(reference)
        want = []
        for row in batches(3):
            reference.zero_grad(set_to_none=True)
            loss = reference(**row).loss
            loss.backward()
            want.append(
                (loss.detach(), {n: q.grad.clone() for n, q in reference.named_parameters() if q.grad is not None})
            )
        for rank in range(2):
            for (loss, grads), (loss2, grads2) in zip(results[rank][wrap][1], want):
                torch.testing.assert_close(loss, loss2, atol=0, rtol=0)
                assert grads.keys() == grads2.keys()
                for name in grads:
                    torch.testing.assert_close(grads[name], grads2[name], atol=1e-6, rtol=1e-5, msg=name)


# ---- on a GPU: real device memory, clock and offload --------------------------------------------------------

GPU_FIELDS = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def gpu_model(lora=True, layers=4, **fields):
    model = tiny_hf_model("llama", torch.bfloat16, "cuda", num_hidden_layers=layers, **{**GPU_FIELDS, **fields})
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    return model


def gpu_rows(steps=4, tokens=2048):
    return [{k: v.cuda() for k, v in row.items()} for row in batches(steps, tokens)]


def close(got, want, grads_close):
    for (loss, grads), (loss2, grads2) in zip(got, want):
        torch.testing.assert_close(loss, loss2, atol=2e-2, rtol=2e-2)
        assert grads.keys() == grads2.keys() and grads
        for name in grads:
            grads_close(grads[name], grads2[name], atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.gpu
def test_gpu_step_peaks_within_the_budget(monkeypatch, grads_close):
    """A budget halfway between full recompute and keeping everything: a plan between the two, and every
    planned step's allocated peak within the budget; losses and gradients those of full recompute."""
    monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "0")  # the tiny layers' inputs are offloaded too: the floor
    rows = gpu_rows(8)
    want = train(ft_hf.apply(gpu_model()), rows)
    gc.collect()
    torch.cuda.empty_cache()
    model = gpu_model()
    probe = MemoryPlanner(1 << 50)
    ft_hf.apply(model, memory_budget=probe)
    got = train(model, rows[:3])
    keep = sum(c.bytes_for(mp.KEEP, 2048) - c.bytes_for(c.floor, 2048) for c in probe.costs)
    budget = probe.plan.floor_peak + keep // 2
    p = ft_hf.use_memory_plan(model, MemoryPlanner(budget))  # measured again, on the same model
    got += train(model, rows[3:5])
    assert p.plan.counts()["keep"] < len(probe.costs) and p.plan.seconds < p.plan.floor_seconds, str(p.plan)
    assert p.plan.peak <= budget
    for row in rows[5:]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        got += train(model, [row])
        assert torch.cuda.max_memory_allocated() <= budget, (torch.cuda.max_memory_allocated(), str(p.plan))
    close(got[:1], want[:1], grads_close)  # the first step, measured
    for (loss, _), (loss2, _) in zip(got, want):  # (the SGD steps' rounding differs a little from there)
        torch.testing.assert_close(loss, loss2, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_budget_forms():
    model = gpu_model()
    p = MemoryPlanner(0.9)
    ft_hf.apply(model, memory_budget=p)
    train(model, gpu_rows(3))
    free, total = torch.cuda.mem_get_info()
    assert p.plan.budget == int(0.9 * total) and p.plan.counts()["keep"] == 4
    auto = MemoryPlanner("auto")
    memory = mm.CudaMemory(torch.device("cuda"))
    assert 0 < auto.resolve_budget(memory) <= free + torch.cuda.memory_reserved()


@pytest.mark.gpu
@pytest.mark.parametrize("extra", ["liger", "graphs", "qlora"])
def test_gpu_compositions(extra, tmp_path, monkeypatch, grads_close):
    """Each choice the layer may take, forced, against full recompute: with Liger's kernels (its RoPE writes
    into the q/k GEMM results in place: those are not saved), CUDA graphs (keep, recompute, offload), QLoRA."""
    monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "0")

    def build_one():
        if extra == "qlora":
            pytest.importorskip("bitsandbytes")
            peft = pytest.importorskip("peft")
            path = tmp_path / "model"
            if not path.exists():
                tiny_hf_model("llama", num_hidden_layers=4, **GPU_FIELDS).save_pretrained(path)
            q = transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
            )
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0}
            ).train()
            torch.manual_seed(0)  # the same adapters in every build (gpu_model's come from tiny_hf_model's seed)
            return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
        model = gpu_model()
        if extra == "liger":
            liger = pytest.importorskip("liger_kernel.transformers")
            from transformers.models.llama import modeling_llama

            for name, value in list(vars(modeling_llama).items()):  # Liger patches the module: put it back after
                monkeypatch.setattr(modeling_llama, name, value)
            liger.apply_liger_kernel_to_llama(model=ft_hf.hf_model(model))
        return model

    graphs = extra == "graphs"
    rows = gpu_rows(3)
    want = train(ft_hf.apply(build_one(), graphs=graphs), rows)
    choices = [mp.KEEP, mp.RECOMPUTE, mp.OFFLOAD] + ([] if graphs else [mp.SELECTIVE])
    for choice in choices:
        p = MemoryPlanner(1 << 50, choices=(choice,))
        model = ft_hf.apply(build_one(), memory_budget=p, graphs=graphs)
        got = train(model, rows)
        assert p.plan.counts()[choice] == 4, str(p.plan)
        close(got[:1], want[:1], grads_close)
