"""fastft.integrations.transformers.rotary: a model's apply_rotary_pos_emb through fastft.rotary in its attention
layers' training forwards (tiny transformers models): each form fastft takes (Llama's, the partial one of Phi-3,
OLMo-2's cast, gpt-oss's half-width angles; the interleaved pairs of Cohere, GLM, Helium and Ernie 4.5) trains as
the model's own, loss and every gradient; evaluation,
generation and another model of the same family in the same process untouched; another form and another
library's instance patch left (apply says which); revert puts the module's function back once no model uses
it."""

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations.transformers import rotary as ft_rotary  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FORMS = {  # config class, fields -> its modeling module, the form of its apply_rotary_pos_emb
    "LlamaConfig": (dict(), "llama", ft_rotary.Form(partial=False, cast=False)),
    "Phi3Config": (dict(partial_rotary_factor=0.5), "phi3", ft_rotary.Form(partial=True, cast=False)),
    "Olmo2Config": (dict(), "olmo2", ft_rotary.Form(partial=False, cast=True)),
    "GptOssConfig": (
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
        "gpt_oss",
        ft_rotary.Form(partial=False, cast=False, halves=True),
    ),
    "CohereConfig": (dict(), "cohere", ft_rotary.Form(partial=False, cast=True, one_dtype=True, interleaved=True)),
    "GlmConfig": (
        dict(head_dim=16, partial_rotary_factor=0.5),
        "glm",
        ft_rotary.Form(partial=True, cast=False, repeat=True, interleaved=True),
    ),
    "HeliumConfig": (
        dict(head_dim=16),
        "helium",
        ft_rotary.Form(partial=False, cast=False, repeat=True, interleaved=True),
    ),
    "Ernie4_5Config": (
        dict(head_dim=16),
        "ernie4_5",
        ft_rotary.Form(partial=False, cast=True, repeat=True, one_dtype=True, interleaved=True),
    ),
}


def build(config_cls, fields):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**TINY, **fields)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def modeling(name):
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


@pytest.fixture(autouse=True)
def clean_modules(monkeypatch):
    """Each test starts from transformers' own functions and no installs: models other tests applied and never
    reverted keep fastft's function installed in their modules (it serves only their marked forwards)."""
    monkeypatch.setattr(ft_rotary, "_installed", {})
    for name in ("llama", "qwen3", "phi3", "olmo2", "gpt_oss", "cohere", "glm", "helium", "ernie4_5"):
        module = modeling(name)
        fn = module.apply_rotary_pos_emb
        monkeypatch.setattr(module, "apply_rotary_pos_emb", getattr(fn, "fastft_replaced", fn))


@pytest.mark.parametrize("config_cls", list(FORMS))
def test_training_step_is_the_models_own(config_cls, monkeypatch):
    fields, name, form = FORMS[config_cls]
    module = modeling(name)
    stock_fn = module.apply_rotary_pos_emb
    assert ft_rotary.rotary_form(stock_fn) == form
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want = step(build(config_cls, fields), ids)
    model = build(config_cls, fields)
    calls = []
    op = ft_rotary.rotary
    monkeypatch.setattr(ft_rotary, "rotary", lambda *a, **k: calls.append(a[2].shape[-1]) or op(*a, **k))
    assert ft_hf.use_rotary(model) == (2, [])
    assert module.apply_rotary_pos_emb is not stock_fn
    got = step(model, ids)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert calls == [int(head_dim * fields.get("partial_rotary_factor", 1.0))] * 2
    torch.testing.assert_close(got[0], want[0], **FP32)
    assert got[1].keys() == want[1].keys()
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], **FP32, msg=key)
    calls.clear()
    other = build(config_cls, fields)  # a model of the same family not under fastft: its own rotary
    assert step(other, ids)[0] == want[0] and not calls
    model.eval()  # evaluation and generation: the model's own rotary
    with torch.no_grad():
        stock = build(config_cls, fields).eval()
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)
        tokens = model.generate(ids[:1, :4], max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, stock.generate(ids[:1, :4], max_new_tokens=4, do_sample=False))
    assert not calls
    ft_hf.revert(model)
    assert module.apply_rotary_pos_emb is stock_fn


def test_revert_puts_the_function_back_once_no_model_uses_it():
    module = modeling("qwen3")
    stock_fn = module.apply_rotary_pos_emb
    first = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False)
    second = ft_hf.apply(tiny_hf_model("qwen3", seed=1), offload_checkpointing=False)
    attention = [m for m in first.modules() if "forward" in m.__dict__ and type(m).__name__ == "Qwen3Attention"]
    assert len(attention) == first.config.num_hidden_layers
    ft_hf.revert(first)
    assert module.apply_rotary_pos_emb is not stock_fn  # the second model still runs it
    assert not any("forward" in m.__dict__ for m in attention)
    ft_hf.revert(second)
    assert module.apply_rotary_pos_emb is stock_fn
    model = ft_hf.apply(tiny_hf_model("qwen3"), offload_checkpointing=False, rotary=False)
    assert module.apply_rotary_pos_emb is stock_fn
    ft_hf.revert(model)


def test_arguments_it_does_not_take_go_to_the_replaced_function():
    """cos of another dtype (Llama's products would promote), another unsqueeze_dim, cos that requires grad:
    the replaced function, marked forward or not."""
    module = modeling("llama")
    stock_fn = module.apply_rotary_pos_emb
    model = tiny_hf_model("llama")
    ft_hf.use_rotary(model)
    fn = module.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    cos, sin = torch.randn(1, 5, 16, generator=g), torch.randn(1, 5, 16, generator=g)
    ft_rotary._marked.depth = 1  # as inside a marked attention forward
    try:
        for args, kwargs in [
            ((q.bfloat16(), k.bfloat16(), cos, sin), {}),
            ((q.transpose(1, 2), k.transpose(1, 2), cos, sin), dict(unsqueeze_dim=2)),
            ((q, k, cos.requires_grad_(), sin), {}),
            ((q, k, cos[..., :8].detach(), sin[..., :8]), {}),  # Llama's full form: stock raises
        ]:
            try:
                want = stock_fn(*args, **kwargs)
            except RuntimeError:
                with pytest.raises(RuntimeError):
                    fn(*args, **kwargs)
                continue
            got = fn(*args, **kwargs)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    finally:
        ft_rotary._marked.depth = 0
        ft_hf.revert(model)


def test_other_forms_and_instance_patches_are_left_and_named(monkeypatch):
    module = modeling("llama")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # another form: scaled
        return q * 2, k * 2

    monkeypatch.setattr(module, "apply_rotary_pos_emb", apply_rotary_pos_emb)
    model = tiny_hf_model("llama")
    with pytest.warns(RuntimeWarning, match="own apply_rotary_pos_emb .*: LlamaAttention"):
        ft_hf.apply(model, offload_checkpointing=False)
    assert module.apply_rotary_pos_emb is apply_rotary_pos_emb
    ft_hf.revert(model)
    monkeypatch.undo()
    model = tiny_hf_model("llama")
    patched = model.model.layers[0].self_attn
    patched.forward = lambda *a, **k: None  # another library's instance patch
    with pytest.warns(RuntimeWarning, match="own apply_rotary_pos_emb .*: LlamaAttention"):
        ft_hf.apply(model, offload_checkpointing=False)
    assert "forward" in model.model.layers[1].self_attn.__dict__
    ft_hf.revert(model)
    assert "forward" in patched.__dict__
