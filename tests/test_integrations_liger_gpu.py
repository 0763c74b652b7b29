"""fastft with Liger-Kernel on the GPU: ``apply`` on a model that Liger patched in place (its defaults:
RMSNorm, rotary, SwiGLU or fused MoE, fused linear cross entropy), or patched after ``apply`` as
``Trainer(use_liger_kernel=True)`` does, gives the loss and gradients of Liger alone. One packed row
through fastft + Liger in bf16 against Liger alone on each document by itself, in fp32 (the reference):
fastft + Liger is as close to it as Liger alone in bf16 is (1.5 x its relative error + 5e-3), for the loss
and every gradient. Tiny configs, and the benchmark's shapes with two layers and 1024 tokens (a few
documents: each is a run of its own, and Liger compiles its kernels per length)."""

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
liger = pytest.importorskip("liger_kernel.transformers")

from fastft.e2e.models import MODEL_CONFIGS, sft_lengths  # noqa: E402
from fastft.integrations import transformers as ft_hf  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

FAMILIES = {"llama": "Llama-3.2-1B", "qwen3": "Qwen3-0.6B", "qwen3_moe": "Qwen3-30B-A3B", "gpt_oss": "gpt-oss-20b"}


@pytest.fixture
def restore_transformers():
    """Liger also patches transformers' modeling modules (classes, rotary): put them back after each test."""
    modules = [importlib.import_module(f"transformers.models.{f}.modeling_{f}") for f in FAMILIES]
    saved = [(m, dict(vars(m))) for m in modules]
    yield
    for module, names in saved:
        for extra in set(vars(module)) - set(names):
            delattr(module, extra)
        vars(module).update(names)


def build(family, size):
    if size == "tiny":
        return tiny_hf_model(family, torch.float32, "cuda"), 128, 256
    config_cls, fields, _ = MODEL_CONFIGS[FAMILIES[family]]
    config = getattr(transformers, config_cls)(**dict(fields, num_hidden_layers=2), use_cache=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    return model, 128000, 1024


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def loss_and_grads(model, parts):
    """sum(weight * loss) over (batch, weight) parts, backward; (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    total = sum(w * model(**batch).loss for batch, w in parts)
    total.backward()
    return dict(
        loss=total.detach()[None], **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    )


@pytest.mark.parametrize("size", ["tiny", "real"])
@pytest.mark.parametrize("family,order", [(f, "liger first") for f in FAMILIES] + [("qwen3_moe", "liger after")])
def test_fastft_with_liger_matches_liger_alone(family, order, size, restore_transformers):
    model, vocab, tokens = build(family, size)
    if family == "gpt_oss":
        model.set_attn_implementation("eager")  # the one that takes its sinks
    patch = getattr(liger, f"apply_liger_kernel_to_{family}")
    lengths = sft_lengths(tokens, median=40 if size == "tiny" else 380, seed=5)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(6)).cuda()
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    labels = ids.masked_fill(positions == 0, -100)  # no document predicts the next one's first token
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    count = sum(n - 1 for n in lengths)
    alone = [
        (dict(input_ids=ids[:, a : a + n], labels=ids[:, a : a + n]), (n - 1) / count) for a, n in zip(starts, lengths)
    ]
    packed = [(dict(input_ids=ids, labels=labels, position_ids=positions), 1.0)]

    if order == "liger first":
        patch(model=model)
    reference = loss_and_grads(model, alone) if order == "liger first" else None
    model.to(torch.bfloat16)
    if order == "liger after":  # as Trainer(use_liger_kernel=True): Liger inside train(), after apply
        ft_hf.apply(model)
        patch(model=model)
        with pytest.warns(UserWarning, match="after fastft's apply"):
            ours = loss_and_grads(model, packed)
        ft_hf.revert(model)  # Liger alone from here
        model.to(torch.float32)
        reference = loss_and_grads(model, alone)
        model.to(torch.bfloat16)
        liger_bf16 = loss_and_grads(model, alone)
    else:
        liger_bf16 = loss_and_grads(model, alone)
        if family == "qwen3_moe":
            with pytest.warns(UserWarning, match="before fastft's apply"):
                ft_hf.apply(model)
        else:
            ft_hf.apply(model)
        ours = loss_and_grads(model, packed)
    assert ours.keys() == reference.keys()
    for key in reference:
        bound = 1.5 * rel_err(liger_bf16[key], reference[key]) + 5e-3
        assert rel_err(ours[key], reference[key]) <= bound, key
