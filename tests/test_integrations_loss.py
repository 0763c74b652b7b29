"""fastft.integrations.transformers.loss: a training forward's causal-LM loss through fastft.linear_cross_entropy
(tiny transformers models): the loss and every gradient as the model's own, with and without
num_items_in_batch, PEFT LoRA, tuple outputs; logits=None only there; every other forward (eval, no_grad,
no labels) untouched; the models it cannot serve exactly warned about and left as they were; revert."""

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastft  # noqa: E402
import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations.transformers import loss as ft_loss  # noqa: E402
from fastft.testing import tiny_hf_model  # noqa: E402

FP32 = dict(atol=1e-5, rtol=1e-5)
TINY = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1,
)  # fmt: skip


def batch(seed=1, rows=2, tokens=24):
    ids = torch.randint(0, 128, (rows, tokens), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt left out of the loss
    return ids, labels


def step(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same_step(got, want):
    (out, grads), (out_want, grads_want) = got, want
    torch.testing.assert_close(out.loss, out_want.loss, **FP32)
    assert grads.keys() == grads_want.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads[name], grads_want[name], **FP32, msg=name)


@pytest.mark.parametrize("family, items", [("llama", False), ("llama", True), ("qwen3", True), ("qwen3_moe", False)])
def test_loss_and_gradients_are_the_models_own(family, items, monkeypatch):
    ids, labels = batch()
    kw = {"num_items_in_batch": torch.tensor(37)} if items else {}
    stock = tiny_hf_model(family)
    want = step(stock, ids, labels, **kw)
    assert want[0].logits is not None
    model = ft_hf.apply(tiny_hf_model(family), offload_checkpointing=False)
    calls = []
    op = fastft.linear_cross_entropy
    monkeypatch.setattr(ft_loss, "linear_cross_entropy", lambda *a, **k: calls.append(k) or op(*a, **k))
    got = step(model, ids, labels, **kw)
    assert len(calls) == 1 and calls[0]["reduction"] == ("sum" if items else "mean")
    assert got[0].logits is None and "logits" not in got[0]  # the output says so: no logits were made
    assert_same_step(got, want)
    assert "lm_head.weight" in got[1]  # the head's own gradient too (a full fine-tune)


@pytest.mark.parametrize(
    "config_cls, fields, softcap",
    [
        ("GraniteConfig", dict(logits_scaling=3.0), None),
        ("CohereConfig", dict(logit_scale=0.37), None),
        ("Gemma2Config", dict(head_dim=16, final_logit_softcapping=0.5), 0.5),
        ("Gemma3TextConfig", dict(head_dim=16, final_logit_softcapping=None), None),
        ("RecurrentGemmaConfig", dict(num_hidden_layers=3, lru_width=32, logits_soft_cap=0.5), 0.5),
        ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=32), None),
    ],
)
def test_models_that_scale_or_cap_their_logits(config_cls, fields, softcap, monkeypatch):
    """Granite divides its logits by ``config.logits_scaling``, Cohere multiplies them by ``logit_scale``, Gemma
    soft-caps them where ``final_logit_softcapping`` is set, RecurrentGemma always, OPT copies them: the fused
    loss scales and caps each block's logits the same way (and their gradient)."""
    ids, labels = batch()
    fields = {**TINY, **fields}

    def model():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**fields)).train()

    want = step(model(), ids, labels)
    assert ft_loss.blocker(model()) is None
    calls = []
    op = fastft.linear_cross_entropy
    monkeypatch.setattr(ft_loss, "linear_cross_entropy", lambda *a, **k: calls.append(k) or op(*a, **k))
    fused = model()
    assert ft_hf.use_linear_cross_entropy(fused)  # RecurrentGemma's mixers are not apply's: the loss alone
    got = step(fused, ids, labels)
    assert got[0].logits is None and [k["softcap"] for k in calls] == [softcap]
    assert_same_step(got, want)


def test_other_forwards_keep_their_logits():
    ids, labels = batch()
    stock, model = tiny_hf_model("llama"), ft_hf.apply(tiny_hf_model("llama"), offload_checkpointing=False)
    with torch.no_grad():
        want = stock(input_ids=ids, labels=labels)
        got = model(input_ids=ids, labels=labels)  # no grad: the loss of an evaluation loop
    torch.testing.assert_close(got.logits, want.logits, **FP32)
    torch.testing.assert_close(got.loss, want.loss, **FP32)
    stock.eval(), model.eval()
    got, want = model(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.logits, want.logits, **FP32)
    model.train(), stock.train()
    got, want = model(input_ids=ids), stock(input_ids=ids)  # no labels
    torch.testing.assert_close(got.logits, want.logits, **FP32)
    assert got.loss is None
    stock.eval(), model.eval()
    tokens = model.generate(ids[:1, :6], max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, stock.generate(ids[:1, :6], max_new_tokens=5, do_sample=False))


def test_tuple_output_and_positional_labels():
    ids, labels = batch()
    stock, model = tiny_hf_model("llama"), ft_hf.apply(tiny_hf_model("llama"), offload_checkpointing=False)
    want = stock(input_ids=ids, labels=labels, return_dict=False)
    got = model(input_ids=ids, labels=labels, return_dict=False)
    assert len(got) == len(want) - 1  # (loss, past_key_values...): the logits left out, as logits=None
    torch.testing.assert_close(got[0], want[0], **FP32)
    got = model(ids, None, None, None, None, labels)  # input_ids, attention_mask, position_ids, cache, embeds
    assert got.logits is None
    torch.testing.assert_close(got.loss, want[0], **FP32)


def test_peft_lora_model():
    peft = pytest.importorskip("peft")
    ids, labels = batch()

    def lora():
        return peft.get_peft_model(tiny_hf_model("qwen3"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    want = step(lora(), ids, labels)
    model = ft_hf.apply(lora(), offload_checkpointing=False)
    got = step(model, ids, labels)
    assert got[0].logits is None
    assert_same_step(got, want)
    assert all("lora_" in name for name in got[1])


class ClampedLlama(transformers.LlamaForCausalLM):
    """A causal LM whose forward changes its logits in a way the fused loss does not follow."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits.clamp(-0.1, 0.1)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_a_model_it_cannot_serve_warns_and_keeps_its_loss():
    ids, labels = batch()
    model = ClampedLlama(tiny_hf_model("llama").config).train()
    assert ft_loss.blocker(tiny_hf_model("llama")) is None
    with pytest.warns(RuntimeWarning, match="keeps the model's own loss .*changes the logits between its head"):
        ft_hf.use_linear_cross_entropy(model)
    assert "forward" not in model.__dict__
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.loss is not None


def test_a_deep_copy_runs_its_own_weights():
    """A reference model copied after apply (TRL's) computes with its own weights, not the original's."""
    import copy

    ids, labels = batch()
    want = step(tiny_hf_model("llama"), ids, labels)
    model = ft_hf.apply(tiny_hf_model("llama"), offload_checkpointing=False)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
        model.model.embed_tokens.weight.mul_(2)
    got = step(twin, ids, labels)
    assert got[0].logits is None
    assert_same_step(got, want)


def test_a_head_sharded_on_its_own_is_a_clear_error():
    class DTensor(torch.Tensor):  # what FSDP2 leaves in a resharded unit's parameters (by its name)
        pass

    ids, labels = batch()
    model = ft_hf.apply(tiny_hf_model("llama"), offload_checkpointing=False)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().as_subclass(DTensor))
    assert type(model.lm_head.weight) is DTensor
    with pytest.raises(RuntimeError, match="head is an FSDP2 unit of its own"):
        model(input_ids=ids, labels=labels)


def test_heads_and_losses_it_leaves_alone():
    model = tiny_hf_model("llama")
    model.loss_function = lambda *a, **k: 0
    assert "loss function set on the instance" in ft_loss.blocker(model)
    model = tiny_hf_model("llama")
    model.loss_type = "ForMaskedLM"
    assert "not ForCausalLMLoss" in ft_loss.blocker(model)
    model = tiny_hf_model("llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert "not a plain nn.Linear" in ft_loss.blocker(model)
    model = tiny_hf_model("llama")
    model.config.vocab_size = 100
    assert "is not its head's 128 rows" in ft_loss.blocker(model)
    model = tiny_hf_model("llama")
    model.forward = model.forward  # another library's instance patch
    assert "forward set on the instance" in ft_loss.blocker(model)
    granite = transformers.GraniteConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, logits_scaling=0.0,
    )  # fmt: skip
    assert "not a finite nonzero number" in ft_loss.blocker(transformers.AutoModelForCausalLM.from_config(granite))
    gemma = transformers.Gemma2Config(**TINY, head_dim=16, final_logit_softcapping=-1.0)
    assert "not None or a finite positive number" in ft_loss.blocker(
        transformers.AutoModelForCausalLM.from_config(gemma)
    )
    assert "forward set on the instance" in ft_loss.blocker(model)


def test_revert_and_loss_false():
    ids, labels = batch()
    model = ft_hf.apply(tiny_hf_model("llama"), offload_checkpointing=False, loss=False)
    assert model(input_ids=ids, labels=labels).logits is not None
    ft_hf.revert(model)
    ft_hf.apply(model, offload_checkpointing=False)
    assert {"forward", "_loss_function"} <= set(model.__dict__) and "forward" in model.lm_head.__dict__
    ft_hf.revert(model)
    assert not {"forward", "_loss_function"} & set(model.__dict__) and "forward" not in model.lm_head.__dict__
    assert model(input_ids=ids, labels=labels).logits is not None
    with pytest.raises(TypeError, match="loss must be True or False"):
        ft_hf.apply(model, loss="yes")
    ft_hf.apply(model, offload_checkpointing=False)
    theirs = model.forward = functools.partial(type(model).forward, model)  # a later patch (Liger's, Trainer's)
    ft_hf.revert(model)
    assert model.__dict__["forward"] is theirs and "_loss_function" not in model.__dict__
