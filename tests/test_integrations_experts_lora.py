"""LoRA on MoE experts' weights (PEFT ``target_parameters``) through fastft's experts path
(``fastft.integrations.peft``, ``experts_forward``'s adapters): PEFT's own forward is the reference, and
PEFT's ``W + B A`` is never formed on fastft's path."""

import copy

import pytest
import torch

import fastft.experts
from fastft import testing
from fastft.integrations import peft as ft_peft
from fastft.integrations import transformers as ft_hf

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
ParamWrapper = pytest.importorskip("peft.tuners.lora.layer").ParamWrapper

BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(autouse=True)
def torch_routing_on_cpu(monkeypatch):
    """Routing's torch backend on CPU: its Triton kernels are tested in test_routing.py, and the interpreter
    would take most of these tests' time."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("FASTFT_BACKEND", "torch")


def lora_model(family, seed, targets=BOTH, train_experts=False, modules=("q_proj",), device="cpu", **lora):
    model = testing.tiny_hf_model(family, device=device)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(modules), target_parameters=targets, **lora)
    model = peft.get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero: make the adapters matter
    for name, p in model.named_parameters():
        if train_experts and name.endswith(("gate_up_proj", "down_proj")) and "lora" not in name:
            p.requires_grad_(True)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def forbid_materialising(monkeypatch):
    """PEFT's ways to form ``W + scaling B A`` (the parametrization, and the factors or delta it is built from)
    raise."""

    def fail(*args, **kwargs):
        raise AssertionError("PEFT formed W + B A")

    for name in ("_activate_lora", "get_delta_factors", "get_delta_weight"):
        monkeypatch.setattr(ParamWrapper, name, fail)


def count_lora_calls(monkeypatch):
    """Calls of ``fastft.experts.routed_experts`` with adapters."""
    calls, real = [], fastft.experts.routed_experts

    def counted(*args, **kwargs):
        if kwargs.get("up_lora") is not None or kwargs.get("down_lora") is not None:
            calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(fastft.experts, "routed_experts", counted)
    return calls


@pytest.mark.parametrize(
    "family, targets, options",
    [
        ("qwen3_moe", BOTH, {}),
        ("gpt_oss", BOTH, dict(use_rslora=True)),  # transposed weights, biases, scaling alpha / sqrt(r)
        ("qwen3_moe", ["mlp.experts.down_proj"], dict(train_experts=True)),  # one weight; the weights train too
    ],
)
def test_matches_peft_without_forming_w_plus_ba(family, targets, options, monkeypatch, rng):
    """``apply`` on a PEFT model with LoRA on the experts: loss and every gradient as PEFT's own forward (fp32),
    with PEFT's ways of forming ``W + B A`` made to raise."""
    seed = int(torch.randint(1 << 30, (), generator=rng))
    options = dict(options)
    train_experts = options.pop("train_experts", False)
    ref = lora_model(family, seed, targets, train_experts, **options)
    model = ft_hf.apply(copy.deepcopy(ref), offload_checkpointing=False)
    wrappers = [m for m in model.modules() if "forward" in vars(m) and isinstance(m, ParamWrapper)]
    assert len(wrappers) == 2  # the outermost wrapper of each layer's experts block
    ids = testing.clear_of_router_ties(ref, lambda: dict(input_ids=torch.randint(0, 128, (2, 12), generator=rng)))
    ids = ids["input_ids"]
    want, want_grads = loss_and_grads(ref, ids)  # PEFT's forward on transformers' experts implementation
    forbid_materialising(monkeypatch)
    calls = count_lora_calls(monkeypatch)
    loss, grads = loss_and_grads(model, ids)
    assert len(calls) == 2 and all((c["up_lora"] is not None) == (len(targets) == 2) for c in calls)
    torch.testing.assert_close(loss, want, **TOL)
    lora_on_experts = sum("experts" in n and "lora" in n for n in grads)
    assert grads.keys() == want_grads.keys() and lora_on_experts == 4 * len(targets)
    assert any(n.endswith("down_proj") and "lora" not in n for n in grads) == train_experts
    for key in grads:
        torch.testing.assert_close(grads[key], want_grads[key], **TOL, msg=key)


def test_peft_forward_where_fastft_does_not_apply_and_revert(monkeypatch, rng):
    """Merged adapters, disabled adapters, several active adapters (with a warning), experts not on fastft's
    path: PEFT's own forward, same result; ``revert`` puts the wrappers back on PEFT's forward."""
    seed = int(torch.randint(1 << 30, (), generator=rng))
    ref = lora_model("qwen3_moe", seed)
    model = ft_hf.apply(copy.deepcopy(ref), offload_checkpointing=False)
    ids = testing.clear_of_router_ties(ref, lambda: dict(input_ids=torch.randint(0, 128, (1, 8), generator=rng)))
    ids = ids["input_ids"]
    calls = count_lora_calls(monkeypatch)

    def same(fast_path):
        calls.clear()
        got = model(input_ids=ids).logits
        assert len(calls) == (2 if fast_path else 0)
        torch.testing.assert_close(got, ref(input_ids=ids).logits, **TOL)

    # training forwards (grad on, train mode): those fastft serves; an inference forward is PEFT's own
    same(fast_path=True)
    with model.disable_adapter(), ref.disable_adapter():
        same(fast_path=False)
    model.merge_adapter()
    ref.merge_adapter()
    same(fast_path=False)
    model.unmerge_adapter()
    ref.unmerge_adapter()
    for m in (model, ref):
        m.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=BOTH))
        m.base_model.set_adapter(["default", "other"])
    with pytest.warns(UserWarning, match="2 active LoRA adapters on down_proj: PEFT's forward"):
        same(fast_path=False)
    for m in (model, ref):
        m.base_model.set_adapter("default")
    same(fast_path=True)
    ft_hf.hf_model(model).set_experts_implementation("eager")  # the user's experts implementation
    same(fast_path=False)
    ft_hf.hf_model(model).set_experts_implementation(ft_hf.EXPERTS_IMPLEMENTATION)
    ft_hf.revert(model)
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, ParamWrapper))
    same(fast_path=False)


def test_use_lora_on_experts_alone_and_experts_forward_errors():
    model = lora_model("gpt_oss", 0, modules=())  # LoRA on the experts only: use_lora still has work
    assert ft_peft.has_lora(model)
    ft_peft.use_lora(model)
    assert sum("forward" in vars(m) for m in model.modules()) == 2
    with pytest.raises(ValueError, match="lora_dropout"):  # PEFT refuses dropout on target_parameters itself
        lora_model("gpt_oss", 0, modules=(), lora_dropout=0.1)
    block = ft_hf.hf_model(model).model.layers[0].mlp.experts.get_base_layer()
    x, ids, w = torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
    lora = fastft.experts.ExpertLoRA(torch.zeros(block.down_proj.shape[0], 2, 64), torch.zeros(1), 1.0)
    with pytest.raises(ValueError, match=r"adapters on gate_up_proj and down_proj only, got \['up_proj'\]"):
        ft_hf.experts_forward(block, x, ids, w, fastft_expert_lora={"up_proj": lora})
    names = ("gate_up_proj", "down_proj")
    shard = ft_hf.ExpertShard(None, 0, 1, block.down_proj.shape[0], names, tuple(getattr(block, n) for n in names))
    block.__dict__[ft_hf.EXPERT_SHARD] = shard
    with pytest.raises(ValueError, match="expert parallelism does not take LoRA on the experts"):
        ft_hf.experts_forward(block, x, ids, w, fastft_expert_lora={"gate_up_proj": lora})


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_on_the_gpu_within_peft_own_bf16_error(family, monkeypatch, rng):
    """One experts block in CUDA bf16 (``torch._grouped_mm``, r=4 padded to 8) on a fixed routing: fastft's
    path and PEFT's own forward in bf16, each against PEFT in fp32 on the same weights; fastft's error within
    twice PEFT's (output, input and adapter gradients), and PEFT's ``W + B A`` not formed on fastft's path.
    (A whole model is not compared: bf16 rounding flips near-tied router choices.)"""
    seed = int(torch.randint(1 << 30, (), generator=rng))
    ref = lora_model(family, seed, device="cuda")
    peft_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    model = ft_hf.apply(copy.deepcopy(peft_bf16), offload_checkpointing=False)
    blocks = [ft_hf.hf_model(m).model.layers[0].mlp.experts for m in (ref, peft_bf16, model)]
    num_experts, tokens = blocks[0].get_base_layer().down_proj.shape[0], 512
    x = torch.randn(tokens, 64, generator=rng).cuda()
    ids = torch.randint(0, num_experts, (tokens, 2), generator=rng).cuda()
    weights = torch.rand(tokens, 2, generator=rng).cuda()
    grad = torch.randn(tokens, 64, generator=rng).cuda()

    def run(block, dtype):
        xs = x.to(dtype).detach().requires_grad_()
        out = block(xs, ids, weights.to(dtype))
        (out.float() * grad).sum().backward()
        return {"out": out.detach(), "x": xs.grad} | {n: p.grad for n, p in block.named_parameters() if "lora" in n}

    want, theirs = run(blocks[0], torch.float32), run(blocks[1], torch.bfloat16)
    forbid_materialising(monkeypatch)
    calls = count_lora_calls(monkeypatch)
    ours = run(blocks[2], torch.bfloat16)
    assert len(calls) == 1 and ours.keys() == want.keys() and len(want) == 6

    def err(got, ref_value):
        return float((got.float() - ref_value).norm() / ref_value.norm().clamp_min(1e-12))

    for key, ref_value in want.items():
        assert err(ours[key], ref_value) <= max(2 * err(theirs[key], ref_value), 1e-2), (key, err(ours[key], ref_value))
