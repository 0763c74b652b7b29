"""fastft.integrations.transformers.norms: a model's RMSNorm layers through fastft.rms_norm in training forwards
(tiny transformers models): each form fastft takes (Llama's, OLMo-2's, Gemma's 1 + weight, the gated norms of
Qwen3.5's, Kimi-Linear's and the Mamba-2 hybrids' mixers, in groups for Nemotron-H, Zamba2 and Falcon-H1) trains
as the model's own, loss and every gradient; evaluation and
generation untouched; a weight of another dtype, a norm of another form, another library's instance patch left on
their own forward (apply says which); revert."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integrations_mixers import HYBRIDS, tiny  # noqa: E402

import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations.transformers import norms as ft_norms  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip
FORMS = {  # config class, fields -> the form of its norms: (eps attribute, offset, weight of x's dtype)
    "LlamaConfig": (dict(), ("variance_epsilon", 0.0, True)),
    "Olmo2Config": (dict(), ("variance_epsilon", 0.0, False)),
    "Gemma2Config": (dict(head_dim=16), ("eps", 1.0, False)),
}


def build(config_cls, fields):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**TINY, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    with torch.no_grad():  # norms' weights away from their initial 1 (or 0): the weight's part shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.5, 0.3)
    return model


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config_cls", list(FORMS))
def test_training_step_is_the_models_own(config_cls, monkeypatch):
    fields, form = FORMS[config_cls]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want = step(build(config_cls, fields), ids)
    model = build(config_cls, fields)
    norms = [m for m in model.modules() if ft_norms.is_rms_norm(m)]
    assert norms and all(ft_norms.norm_form(type(m)) == form for m in norms)
    calls = []
    op = ft_norms.rms_norm
    monkeypatch.setattr(ft_norms, "rms_norm", lambda *a, **k: calls.append(k) or op(*a, **k))
    taken, left = ft_hf.use_rms_norm(model)
    assert (taken, left) == (len(norms), [])
    got = step(model, ids)
    assert len(calls) == len(norms) and {k["offset"] for k in calls} == {form[1]}
    torch.testing.assert_close(got[0], want[0], **FP32)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **FP32, msg=name)
    calls.clear()
    model.eval()  # evaluation and generation: the model's own norms
    with torch.no_grad():
        stock = build(config_cls, fields).eval()
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)
        tokens = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, stock.generate(ids[:1, :4], max_new_tokens=4, do_sample=False))
    assert not calls


def test_apply_takes_norms_and_revert_gives_them_back():
    model = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False)
    norms = [m for m in model.modules() if ft_norms.is_rms_norm(m)]
    assert len(norms) == 2 * 4 + 1  # per layer: input, post-attention, q and k norms; the final norm
    assert all("forward" in m.__dict__ for m in norms)
    ft_hf.revert(model)
    assert not any("forward" in m.__dict__ for m in norms)
    model = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False, norms=False)
    assert not any("forward" in m.__dict__ for m in model.modules() if ft_norms.is_rms_norm(m))


def test_a_weight_of_another_dtype_and_keyword_calls_keep_the_class_forward():
    """Llama's ``weight * x.to(input_dtype)`` promotes to the weight's dtype: an fp32 weight beside bf16 rows gives
    fp32, which fastft.rms_norm (x's dtype) would not: the norm keeps its own forward there."""
    model = tiny_hf_model("llama")
    ft_hf.use_rms_norm(model)
    norm = model.model.norm
    x = torch.randn(3, 64).bfloat16()
    out = norm(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, type(norm).forward(norm, x))
    x = torch.randn(3, 64)
    assert torch.equal(norm(hidden_states=x), type(norm).forward(norm, x))  # by keyword: the class's forward


def test_other_forms_and_instance_patches_are_left_and_named():
    class ClampedRMSNorm(transformers.models.llama.modeling_llama.LlamaRMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states).clamp(-1, 1)

    model = tiny_hf_model("llama")
    model.model.norm = ClampedRMSNorm(64)
    patched = model.model.layers[0].input_layernorm
    patched.forward = lambda x: x  # another library's instance patch
    with pytest.warns(RuntimeWarning, match="ClampedRMSNorm, LlamaRMSNorm"):
        ft_hf.apply(model, offload_checkpointing=False)
    assert "forward" not in model.model.norm.__dict__
    assert patched.forward(torch.ones(1)) is not None and "forward" in model.model.layers[1].input_layernorm.__dict__
    ft_hf.revert(model)
    assert "forward" in patched.__dict__  # the other library's patch stays


# case -> (family, config fields beside HYBRIDS', the gate first, channels a group (None: the whole row), the
# gate's activation) of its gated norms (the classes named ...RMSNormGated)
GATED = {
    "qwen3_5_text": ("qwen3_5_text", {}, False, None, "silu"),
    "kimi_linear": ("kimi_linear", {}, False, None, "sigmoid"),
    "bamba": ("bamba", {}, True, None, "silu"),
    "granitemoehybrid": ("granitemoehybrid", {}, True, None, "silu"),
    "nemotron_h": ("nemotron_h", {}, True, 32, "silu"),  # 64 channels in 2 groups
    "zamba2": ("zamba2", dict(mamba_ngroups=2), True, 32, "silu"),  # 64 channels in 2 groups
    "falcon_h1": ("falcon_h1", dict(mamba_rms_norm=True, mamba_n_groups=2), False, 32, "silu"),
    "falcon_h1 gate first": (
        "falcon_h1", dict(mamba_rms_norm=True, mamba_n_groups=2, mamba_norm_before_gate=False), True, 32, "silu"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(GATED))
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_gated_norms_train_as_the_models_own(case, monkeypatch):
    """The mixers' gated norms (``norm(x, gate)``) run fastft.rms_norm with the gate (in groups where theirs
    are): loss and every gradient as the model's own step; evaluation and generation untouched."""
    model_type, fields, first, group_size, activation = GATED[case]

    def build():
        model = tiny(model_type, **{**HYBRIDS[model_type], **fields}).train()
        torch.manual_seed(0)
        with torch.no_grad():
            for param_name, p in model.named_parameters():
                if "norm" in param_name:
                    p.normal_(0.5, 0.3)
        return model

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    want = step(build(), ids)
    model = build()
    gated = [m for m in model.modules() if type(m).__name__.endswith("RMSNormGated")]
    assert gated and all(ft_norms.gated_form(type(m)) is not None for m in gated)
    calls = []
    op = ft_norms.rms_norm
    monkeypatch.setattr(ft_norms, "rms_norm", lambda *a, **k: calls.append(k) or op(*a, **k))
    taken, left = ft_hf.use_rms_norm(model)
    assert not [n for n in left if n.endswith("RMSNormGated")] and all("forward" in m.__dict__ for m in gated)
    got = step(model, ids)
    gates = [k for k in calls if k["gate"] is not None]
    assert len(gates) == len(gated) and {k["gate_first"] for k in gates} == {first}
    assert {k["gate_activation"] for k in gates} == {activation}
    assert {k["group_size"] for k in gates} == {group_size}
    torch.testing.assert_close(got[0], want[0], **FP32)
    assert got[1].keys() == want[1].keys()
    for param_name in want[1]:
        torch.testing.assert_close(got[1][param_name], want[1][param_name], **FP32, msg=param_name)
    calls.clear()
    model.eval()
    with torch.no_grad():
        stock = build().eval()
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)
    assert not calls


def test_gated_norms_of_other_forms_or_calls_keep_their_own_forward(monkeypatch):
    """A gated norm called without a gate where its form needs one or with a gate of another shape: the class's
    forward, and so a grouped form whose groups no longer cut the row into whole groups, Falcon-H1's on inputs its
    forward does not take as fastft computes (4-d; transformers 5.17's 3-d input of one token, which it returns
    in another shape), and a norm whose activation was changed to one fastft has not. A gated form with another
    activation: left, and named."""
    model = tiny("qwen3_5_text", **HYBRIDS["qwen3_5_text"]).train()
    ft_hf.use_rms_norm(model)
    norm = model.model.layers[0].linear_attn.norm
    x, z = torch.randn(6, 8), torch.randn(6, 8)
    assert torch.equal(norm(x, z[:1]), type(norm).forward(norm, x, z[:1]))  # a broadcast gate
    with pytest.raises(TypeError):
        norm(x)  # the form takes a gate: its own forward's error
    calls = []
    op = ft_norms.rms_norm
    monkeypatch.setattr(ft_norms, "rms_norm", lambda *a, **k: calls.append(k) or op(*a, **k))
    nemotron = tiny("nemotron_h", **HYBRIDS["nemotron_h"]).train()  # two groups a row
    ft_hf.use_rms_norm(nemotron)
    norm = next(m for m in nemotron.modules() if type(m).__name__.endswith("RMSNormGated"))
    x, z = torch.randn(6, norm.weight.shape[0]), torch.randn(6, norm.weight.shape[0])
    groups = "group_size" if ft_norms.gated_form(type(norm)).groups == "group_size" else "n_groups"
    setattr(norm, groups, 5)  # 64 channels are not whole groups of 5 (or 5 groups)
    with pytest.raises(RuntimeError):
        norm(x, z)  # its own forward's error
    assert not calls
    falcon = tiny("falcon_h1", **{**HYBRIDS["falcon_h1"], "mamba_rms_norm": True, "mamba_n_groups": 2}).train()
    ft_hf.use_rms_norm(falcon)
    norm = next(m for m in falcon.modules() if type(m).__name__ == "FalconH1RMSNormGated")
    width = norm.weight.shape[0]
    x, z = torch.randn(2, 1, 3, width), torch.randn(2, 1, 3, width)
    with pytest.raises(ValueError):
        norm(x, z)  # 4-d: its own forward's error
    x, z = torch.randn(2, 1, width), torch.randn(2, 1, width)
    out = norm(x, z)
    if ft_norms.gated_form(type(norm)).squeezes_one_token:
        assert torch.equal(out, type(norm).forward(norm, x, z)) and out.shape != x.shape and not calls
    else:
        torch.testing.assert_close(out, type(norm).forward(norm, x, z), **FP32)
        assert out.shape == x.shape and len(calls) == 1
    for changed_after in (False, True):
        kimi = tiny("kimi_linear", **HYBRIDS["kimi_linear"]).train()
        norm = next(m for m in kimi.modules() if type(m).__name__ == "KimiLinearRMSNormGated")
        if not changed_after:  # the form, with an activation fastft.rms_norm has not
            norm.activation = "gelu"
        left = ft_hf.use_rms_norm(kimi)[1]
        assert ("KimiLinearRMSNormGated" in left) != changed_after and ("forward" in norm.__dict__) == changed_after
        norm.activation = "gelu"  # after use_rms_norm: the class's forward
        x, z = torch.randn(6, norm.weight.shape[0]), torch.randn(6, norm.weight.shape[0])
        assert torch.equal(norm(x, z), type(norm).forward(norm, x, z))
