"""fastft.integrations.transformers.lifecycle: a model after ``apply`` generates, evaluates and infers exactly as
without it (every family ``apply`` takes, hybrids included; eval and train mode; greedy and sampling; one row
and a left-padded batch), and still trains on packed rows in between."""

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_integrations_mixers import ATTENTION_ONLY, HYBRIDS, tiny  # noqa: E402

from fastft.integrations.transformers import apply, lifecycle, revert  # noqa: E402

FAMILIES = ATTENTION_ONLY + tuple(sorted(HYBRIDS))
MOE = ("qwen3_moe", "gpt_oss", "glm4_moe", "qwen3_next", "lfm2_moe", "qwen3_5_moe_text")
SMALL_MOE = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)}


def prompts(rng, vocab: int, device) -> dict:
    """One row, and a batch of two rows where the second is left-padded (token 0, mask 0)."""
    one = torch.randint(1, vocab, (1, 5), generator=rng).to(device)
    batch = torch.randint(1, vocab, (2, 6), generator=rng).to(device)
    mask = torch.ones_like(batch)
    batch[1, :2], mask[1, :2] = 0, 0
    return {"one row": {"input_ids": one}, "left-padded": {"input_ids": batch, "attention_mask": mask}}


def generate(model, inputs, sampling: bool, seed: int):
    torch.manual_seed(seed)
    return model.generate(
        **inputs, max_new_tokens=6, do_sample=sampling, top_k=0, pad_token_id=0, eos_token_id=None, use_cache=True
    )


def outcome(model, inputs, sampling: bool, seed: int):
    """The tokens ``generate`` gives, or the error it raises as (type, message): where the model's own code
    raises (transformers 5.24's SDPA decode of a GQA model with a mask on CUDA), the model after ``apply``
    raises the same."""
    try:
        return generate(model, inputs, sampling, seed)
    except Exception as e:  # noqa: BLE001 - compared with the model's own below
        return type(e), str(e)


def same(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and torch.equal(got, want)
    return got == want


def packed_step(model, rng, device):
    """One training step's loss and gradients on a packed row of three documents."""
    lengths = (4, 7, 3)
    ids = torch.randint(1, model.config.vocab_size, (1, sum(lengths)), generator=rng).to(device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_generate_after_apply_gives_the_models_tokens(model_type, rng, device):
    fields = HYBRIDS.get(model_type, {})
    reference = tiny(model_type, rng, **fields).to(device)
    model = apply(copy.deepcopy(reference))
    seed = int(torch.randint(2**31, (), generator=rng))
    for mode in ("eval", "train"):
        reference.train(mode == "train")
        model.train(mode == "train")
        for name, inputs in prompts(rng, reference.config.vocab_size, device).items():
            for sampling in (False, True):
                want = outcome(reference, inputs, sampling, seed)
                got = outcome(model, inputs, sampling, seed)
                assert same(got, want), f"{model_type}, {mode} mode, {name}, sampling={sampling}: {got} != {want}"
    # nothing was left switched: the next training step is fastft's (packed attention, its checkpoint)
    assert lifecycle.KIND not in model.base_model.__dict__  # the decoder stack
    assert all(m.gradient_checkpointing for m in model.modules() if hasattr(m, "_gradient_checkpointing_func"))
    assert model.config._attn_implementation == "fastft"
    if model_type in MOE:
        assert model.config._experts_implementation == "fastft"
    revert(model)


@pytest.mark.usefixtures("transformers_torch_delta_rule")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "qwen3_5_text"])
def test_eval_forward_with_padding_equals_the_models_own(model_type, rng, device):
    reference = tiny(model_type, rng, **HYBRIDS.get(model_type, {})).to(device).eval()
    model = apply(copy.deepcopy(reference)).eval()
    inputs = prompts(rng, reference.config.vocab_size, device)["left-padded"]
    with torch.no_grad():
        want = reference(**inputs).logits
        got = model(**inputs).logits
    assert torch.equal(got, want)
    with torch.no_grad():  # and a train-mode forward under no_grad, as RL loops score their samples
        reference.train(), model.train()
        assert torch.equal(model(**inputs, use_cache=False).logits, reference(**inputs, use_cache=False).logits)
    revert(model)


@pytest.mark.usefixtures("transformers_torch_delta_rule")
@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_text"])
def test_generate_then_train_keeps_the_training_step(model_type, rng, device):
    """Generating between two training steps changes neither: the steps equal those of a model that never
    generated (packed documents kept apart, fastft's checkpoint on)."""
    fields = HYBRIDS.get(model_type, {})
    model = apply(tiny(model_type, rng, **fields).to(device))
    twin = apply(tiny(model_type, rng=None, **fields).to(device))
    twin.load_state_dict(model.state_dict())
    seed = int(torch.randint(2**31, (), generator=rng))
    inputs = prompts(rng, model.config.vocab_size, device)["left-padded"]
    generate(model.train(), inputs, True, seed)
    rng_state = rng.get_state()
    loss, grads = packed_step(model, rng, device)
    rng.set_state(rng_state)
    twin_loss, twin_grads = packed_step(twin, rng, device)
    torch.testing.assert_close(loss, twin_loss, rtol=0, atol=0)
    assert grads.keys() == twin_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], twin_grads[name], rtol=0, atol=0, msg=name)
    revert(model), revert(twin)


def test_forward_kinds():
    stack = torch.nn.Linear(1, 1)
    pos = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones(1, 3, dtype=torch.long)
    stack.train()
    assert lifecycle.classify(stack, {"position_ids": pos, "attention_mask": mask}) == lifecycle.TRAIN
    assert lifecycle.classify(stack, {"past_key_values": object()}) == lifecycle.STOCK
    assert lifecycle.classify(stack, {"cache": object()}) == lifecycle.STOCK
    with torch.no_grad():
        assert lifecycle.classify(stack, {"position_ids": pos}) == lifecycle.PACKED
        assert lifecycle.classify(stack, {"cu_seq_lens_q": pos[0]}) == lifecycle.PACKED
        assert lifecycle.classify(stack, {"position_ids": pos, "attention_mask": mask}) == lifecycle.STOCK
        assert lifecycle.classify(stack, {}) == lifecycle.STOCK
    stack.eval()
    assert lifecycle.classify(stack, {"position_ids": pos}) == lifecycle.PACKED
    assert lifecycle.classify(stack, {"input_ids": pos}) == lifecycle.STOCK
    # a forward that builds a cache (use_cache, given or the config's) on rows of one document each is
    # generate's first step; on rows of several documents the cache could not be continued: packed
    one = torch.arange(5)[None]
    two = torch.tensor([[0, 1, 2, 0, 1]])
    assert lifecycle.classify(stack, {"position_ids": one, "use_cache": True}) == lifecycle.STOCK
    assert lifecycle.classify(stack, {"position_ids": one, "use_cache": False}) == lifecycle.PACKED
    assert lifecycle.classify(stack, {"position_ids": two, "use_cache": True}) == lifecycle.PACKED
    assert lifecycle.classify(stack, {"cu_seq_lens_q": one[0], "use_cache": True}) == lifecycle.PACKED
    stack.config = types.SimpleNamespace(use_cache=True)
    assert lifecycle.classify(stack, {"position_ids": one}) == lifecycle.STOCK
    assert lifecycle.classify(stack, {"position_ids": two}) == lifecycle.PACKED


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_generate_after_apply_on_a_peft_model(model_type, rng, device, monkeypatch):
    """LoRA through fastft's path in training; PEFT's own forward in generation: the tokens are PEFT's."""
    peft = pytest.importorskip("peft")
    from fastft.integrations import peft as ft_peft

    monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the lifecycle is under test here, not the kernels
    base = tiny(model_type, rng, **SMALL_MOE.get(model_type, {})).to(device)
    reference = peft.get_peft_model(
        base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model = apply(copy.deepcopy(reference))
    calls = []
    lora_linear = ft_peft.lora_linear
    monkeypatch.setattr(ft_peft, "lora_linear", lambda *a, **k: calls.append(1) or lora_linear(*a, **k))
    seed = int(torch.randint(2**31, (), generator=rng))
    for mode in (False, True):
        reference.train(mode), model.train(mode)
        for inputs in prompts(rng, base.config.vocab_size, device).values():
            assert torch.equal(generate(model, inputs, True, seed), generate(reference, inputs, True, seed))
    assert not calls
    packed_step(model, rng, device)  # a training step: fastft's LoRA path
    assert calls
    revert(model)
