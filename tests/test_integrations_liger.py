"""fastft.integrations.liger: Liger-Kernel's MoE experts blocks stay on fastft's experts path (CPU: only
Liger's swiglu patch, whose kernels fastft replaces; the GPU file runs Liger's kernels)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("liger_kernel")

import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations import liger as ft_liger  # noqa: E402
from fastft.testing import clear_of_router_ties, tiny_hf_model  # noqa: E402


@pytest.fixture
def modeling(monkeypatch):
    """transformers' qwen3_moe module, restored after the test (Liger patches its classes too)."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    for name in ("Qwen3MoeExperts", "Qwen3MoeRMSNorm", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_qwen3_moe, name, getattr(modeling_qwen3_moe, name))
    return modeling_qwen3_moe


def swiglu_only(model=None):
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

    apply_liger_kernel_to_qwen3_moe(
        rope=False, rms_norm=False, cross_entropy=False, fused_linear_cross_entropy=False, swiglu=True, model=model
    )


def reference(rng):
    """fastft on a model without Liger, and a packed batch."""
    model = tiny_hf_model("qwen3_moe", seed=int(torch.randint(1 << 30, (), generator=rng)))
    ft_hf.apply(model, offload_checkpointing=False)
    positions = torch.cat([torch.arange(6), torch.arange(8)])[None]

    def draw():
        ids = torch.randint(0, 128, (1, 14), generator=rng)
        return dict(input_ids=ids, labels=ids, position_ids=positions)

    return model, clear_of_router_ties(model, draw)


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def assert_same(model, ref, batch):
    loss, grads = loss_and_grads(model, batch)
    ref_loss, ref_grads = loss_and_grads(ref, batch)
    torch.testing.assert_close(loss, ref_loss, atol=2e-5, rtol=1e-4)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], atol=2e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("order", ["liger first", "fastft first"])
def test_in_place_liger_patch_keeps_fastft_experts(order, modeling, rng):
    ref, batch = reference(rng)
    model = tiny_hf_model("qwen3_moe")
    model.load_state_dict(ref.state_dict())
    experts = [layer.mlp.experts for layer in model.model.layers]
    if order == "liger first":
        swiglu_only(model)
        with pytest.warns(UserWarning, match="before fastft's apply"):
            ft_hf.apply(model, offload_checkpointing=False)
    else:  # as Trainer(use_liger_kernel=True) does inside train()
        ft_hf.apply(model, offload_checkpointing=False)
        swiglu_only(model)
        assert all("forward" in e.__dict__ for e in experts)
        with pytest.warns(UserWarning, match="after fastft's apply"):
            model(**batch)
    assert not any("forward" in e.__dict__ for e in experts)
    assert model.config._experts_implementation == "fastft"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert_same(model, ref, batch)
    ft_hf.revert(model)
    assert all(ft_liger._from_liger(e.forward.__func__) for e in experts)


def test_liger_experts_blocks_run_fastft(modeling, rng):
    ref, batch = reference(rng)
    ref.set_experts_implementation("eager")  # transformers' own experts loop: checks the LigerExperts math too
    swiglu_only()  # class-level: a model built now has LigerExperts blocks
    model = tiny_hf_model("qwen3_moe")
    blocks = [layer.mlp.experts for layer in model.model.layers]
    assert all(ft_liger.is_liger_experts(b) for b in blocks) and not ft_hf.has_experts(model)
    model.load_state_dict(ref.state_dict())
    with pytest.warns(UserWarning, match="2 LigerExperts blocks"):
        ft_hf.apply(model, offload_checkpointing=False)
    assert_same(model, ref, batch)
    ft_hf.revert(model)
    assert not any("forward" in b.__dict__ for b in blocks)


def test_expert_parallel_refuses_liger_experts_blocks(modeling):
    swiglu_only()  # LigerExperts blocks: not transformers' experts blocks, so use_expert_parallel would skip them
    model = tiny_hf_model("qwen3_moe")
    with pytest.warns(UserWarning, match="LigerExperts"):
        ft_hf.apply(model, offload_checkpointing=False)
    with pytest.raises(ValueError, match="LigerExperts"):
        ft_hf.use_expert_parallel(model)
