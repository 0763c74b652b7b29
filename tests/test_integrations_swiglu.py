"""fastft.integrations.transformers.mlps: a model's gated MLPs through fastft.swiglu in training forwards (tiny
transformers models): each form fastft takes (Llama's gate and up projections, Phi-3's fused gate_up_proj) and
each activation (SiLU, Gemma's GELU tanh form) trains as the model's own, loss and every gradient; evaluation and
generation untouched; another activation (GELU's exact form), another form and another library's instance patch
left on their own forward (apply says which); outputs the op does not take fall back to the stock product;
revert."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations.transformers import mlps as ft_mlps  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip
# -> the form's projection, the op's inputs, its activation
FORMS = {
    "LlamaConfig": ("gate_proj", 2, "silu"),
    "Phi3Config": ("gate_up_proj", 1, "silu"),
    "GemmaConfig": ("gate_proj", 2, "gelu_tanh"),
}
EXTRA = {"GemmaConfig": dict(head_dim=16)}


def build(config_cls, **kw):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        **TINY, **EXTRA.get(config_cls, {}), **kw, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    return transformers.AutoModelForCausalLM.from_config(config).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config_cls", list(FORMS))
def test_training_step_is_the_models_own(config_cls, monkeypatch):
    projection, inputs, activation = FORMS[config_cls]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want = step(build(config_cls), ids)
    model = build(config_cls)
    mlps = [m for m in model.modules() if ft_mlps.is_gated_mlp(m)]
    assert len(mlps) == 2 and all(hasattr(m, projection) for m in mlps)
    calls = []
    op = ft_mlps.swiglu
    monkeypatch.setattr(ft_mlps, "swiglu", lambda *a, **k: calls.append((len(a), k["activation"])) or op(*a, **k))
    assert ft_hf.use_swiglu(model) == (2, [])
    got = step(model, ids)
    assert calls == [(inputs, activation)] * 2
    torch.testing.assert_close(got[0], want[0], **FP32)
    assert got[1].keys() == want[1].keys()
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], **FP32, msg=name)
    calls.clear()
    model.eval()  # evaluation and generation: the model's own MLPs
    with torch.no_grad():
        stock = build(config_cls).eval()
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)
        tokens = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, stock.generate(ids[:1, :4], max_new_tokens=4, do_sample=False))
    assert not calls


def test_apply_takes_mlps_and_revert_gives_them_back():
    model = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False)
    mlps = [m for m in model.modules() if ft_mlps.is_gated_mlp(m)]
    assert len(mlps) == model.config.num_hidden_layers and all("forward" in m.__dict__ for m in mlps)
    ft_hf.revert(model)
    assert not any("forward" in m.__dict__ for m in mlps)
    model = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False, swiglu=False)
    assert not any("forward" in m.__dict__ for m in model.modules() if ft_mlps.is_gated_mlp(m))


def test_outputs_the_op_does_not_take_get_the_stock_product(monkeypatch):
    """Projections whose outputs differ in dtype (here up's fp64): ``act(gate) * up``, promoted, as the class
    computes it; a call by keyword: the class's forward."""
    model = tiny_hf_model("llama")
    ft_hf.use_swiglu(model)
    mlp = model.model.layers[0].mlp
    mlp.up_proj = torch.nn.Sequential(mlp.up_proj, Cast())
    mlp.down_proj.double()
    calls = []
    monkeypatch.setattr(ft_mlps, "swiglu", lambda *a, **k: calls.append(a))
    x = torch.randn(3, 64)
    out = mlp(x)
    assert out.dtype == torch.float64 and torch.equal(out, type(mlp).forward(mlp, x))
    assert torch.equal(mlp(x=x), type(mlp).forward(mlp, x))
    assert not calls


class Cast(torch.nn.Module):
    def forward(self, x):
        return x.double()


def test_other_activations_forms_and_instance_patches_are_left_and_named():
    class ScaledMLP(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):
            return super().forward(x) * 2

    model = tiny_hf_model("llama")
    model.model.layers[0].mlp = ScaledMLP(model.config)
    patched = model.model.layers[1].mlp
    patched.forward = lambda x: x  # another library's instance patch
    with pytest.warns(RuntimeWarning, match="gated MLPs on their own forward .*: LlamaMLP, ScaledMLP"):
        ft_hf.apply(model, offload_checkpointing=False)
    assert "forward" not in model.model.layers[0].mlp.__dict__
    ft_hf.revert(model)
    assert "forward" in patched.__dict__  # the other library's patch stays
    erf = build("LlamaConfig", hidden_act="gelu")  # GELU's exact form: not the op's
    with pytest.warns(RuntimeWarning, match="gated MLPs on their own forward .*: LlamaMLP"):
        ft_hf.apply(erf, offload_checkpointing=False)
    assert not any("forward" in m.__dict__ for m in erf.modules() if ft_mlps.is_gated_mlp(m))


def test_activation_names():
    activations = transformers.activations
    assert ft_mlps.activation(torch.nn.SiLU()) == ft_mlps.activation(activations.SiLUActivation()) == "silu"
    for act in (
        activations.GELUTanh(),
        activations.NewGELUActivation(),
        activations.FastGELUActivation(),
        torch.nn.GELU(approximate="tanh"),
    ):
        assert ft_mlps.activation(act) == "gelu_tanh", act
    for act in (torch.nn.GELU(), activations.GELUActivation(), activations.QuickGELUActivation(), torch.nn.ReLU()):
        assert ft_mlps.activation(act) is None, act
