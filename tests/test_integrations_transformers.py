"""fastft.integrations.transformers: MoE experts blocks of real transformers models (tiny configs)."""

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastft  # noqa: E402
import fastft.experts  # noqa: E402
import fastft.integrations.transformers as ft_hf  # noqa: E402
from fastft.integrations.models import STATE, ModelState  # noqa: E402
from fastft.integrations.transformers import attention as ft_attention  # noqa: E402
from fastft.testing import no_host_sync, tiny_hf_model  # noqa: E402

GPU = torch.cuda.is_available()


def tiny(name, dtype):
    return tiny_hf_model(name, dtype, "cuda" if GPU else "cpu")


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_moe_model_matches_transformers_eager(name, monkeypatch, grads_close):
    dtype = torch.bfloat16 if GPU else torch.float32
    model = tiny(name, dtype)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1)).to(model.device)
    model.set_experts_implementation("eager")
    loss, grads = loss_and_grads(model, ids)
    ft_hf.use_moe(model)
    assert model.config._experts_implementation == "fastft"
    routed = []
    monkeypatch.setattr(fastft.experts, "moe_route", lambda *a, **k: routed.append(1) or fastft.moe_route(*a, **k))
    loss2, grads2 = loss_and_grads(model, ids)
    assert len(routed) == model.config.num_hidden_layers  # every experts block ran through fastft
    # fp32: the same math in another summation order; bf16 (GPU): fastft sums the experts in fp32, eager in bf16
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(loss2, loss, **tol)
    assert grads2.keys() == grads.keys()
    for key in grads:
        grads_close(grads2[key], grads[key], **tol, msg=key)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_gate_activation_is_fastft_swiglu_where_it_is_the_gate(name, rng):
    from fastft.integrations.transformers.experts import gate_activation

    block = next(m for m in tiny(name, torch.float32).modules() if type(m).__name__.endswith("Experts"))
    act = gate_activation(block)
    assert getattr(act, "func", act) is fastft.swiglu
    x = (torch.randn(33, block.down_proj.shape[1 if block.is_transposed else 2] * 2, generator=rng) * 4).to(
        block.down_proj.device
    )
    torch.testing.assert_close(act(x), block._apply_gate(x), atol=1e-5, rtol=1e-5)  # the block's own gate
    # anything else keeps the block's own function: another activation, a gate set on the block, a subclass's
    if name == "qwen3_moe":
        block.act_fn = torch.nn.GELU()
        assert gate_activation(block) == block._apply_gate
        block.act_fn = transformers.activations.GELUTanh()  # Gemma 4's experts: GeGLU
        act = gate_activation(block)
        assert act.func is fastft.swiglu and act.keywords == {"activation": "gelu_tanh"}
        torch.testing.assert_close(act(x), block._apply_gate(x), atol=1e-5, rtol=1e-5)
        block.act_fn = torch.nn.SiLU()
        assert gate_activation(block) is fastft.swiglu
    block._apply_gate = lambda h: h[..., : h.shape[-1] // 2]
    assert gate_activation(block) is block._apply_gate
    del block._apply_gate
    block.__class__ = type("Clamped", (type(block),), {"_apply_gate": lambda self, h: h[..., ::2].clamp(max=1.0)})
    assert gate_activation(block) == block._apply_gate


def test_use_moe_rejects_other_objects():
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        ft_hf.use_moe(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has no transformers experts blocks"):
        ft_hf.use_moe(tiny("llama", torch.float32))


@pytest.mark.gpu
def test_experts_block_is_sync_free_on_gpu():
    model = ft_hf.use_moe(tiny("gpt_oss", torch.bfloat16))
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = torch.rand(512, 5, device="cuda").topk(2, dim=1).indices
    ids[:7, 1] = 5  # an expert-parallel sentinel: not routed
    w = torch.rand(512, 2, device="cuda", requires_grad=True)
    with no_host_sync():
        out = experts(x, ids, w)
        out.float().square().sum().backward()
    assert out.shape == x.shape and torch.isfinite(out).all() and torch.isfinite(x.grad).all()


# ---- packed attention and apply ----------------------------------------------------------------------------

LENGTHS = [5, 9, 3, 11]  # documents of one packed row (the longest passes the 6-token sliding window)


def packed_batch(device):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(device)
    return ids, positions


def document_mask(positions, window, dtype):
    """Additive [1, 1, T, T] mask, plain torch: same document, causal, inside the window."""
    doc = (positions[0] == 0).cumsum(0)
    q, k = torch.arange(len(doc)).to(doc.device)[:, None], torch.arange(len(doc)).to(doc.device)[None]
    ok = (doc[:, None] == doc[None]) & (k <= q) & ((q - k < window) if window else True)
    return torch.zeros(ok.shape, dtype=dtype, device=doc.device).masked_fill(~ok, float("-inf"))[None, None]


def forward_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False).logits  # with a cache, stock transformers ignores packed position ids
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "gpt_oss"])
def test_packed_batch_matches_stock_model_and_each_document_alone(name, grads_close):
    dtype = torch.bfloat16 if GPU else torch.float32
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    model = tiny(name, dtype)
    model.set_attn_implementation("eager" if name == "gpt_oss" else "sdpa")  # gpt-oss: sinks need eager
    if name in ("qwen3_moe", "gpt_oss"):
        model.set_experts_implementation("eager")
    ids, positions = packed_batch(model.device)
    stock_batch = dict(input_ids=ids, position_ids=positions)
    if name == "gpt_oss":  # transformers 5.17's gpt-oss ignores packed position ids: give it the masks
        stock_batch["attention_mask"] = {
            "full_attention": document_mask(positions, None, dtype),
            "sliding_attention": document_mask(positions, 6, dtype),
        }
    stock_logits, stock_grads = forward_grads(model, **stock_batch)
    ft_hf.apply(model, offload_checkpointing=False)
    assert model.config._attn_implementation == "fastft"
    logits, grads = forward_grads(model, input_ids=ids, position_ids=positions)
    torch.testing.assert_close(logits, stock_logits, **tol)
    for key in stock_grads:
        grads_close(grads[key], stock_grads[key], **tol, msg=key)
    start = 0
    with torch.no_grad():
        for n in LENGTHS:  # (b) each document alone, unpacked: no document saw another
            alone = model(input_ids=ids[:, start : start + n]).logits
            torch.testing.assert_close(logits[:, start : start + n], alone, **tol)
            start += n


def test_padding_mask_and_flattening_collator():
    model = ft_hf.apply(tiny("llama", torch.float32).cpu(), offload_checkpointing=False)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 128, (5,), generator=g), torch.randint(1, 128, (8,), generator=g)
    with torch.no_grad():
        alone = [model(input_ids=x[None]).logits[0] for x in (a, b)]
        left = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])  # row 0 left-padded
        mask = torch.tensor([[0, 0, 0] + [1] * 5, [1] * 8])
        padded = model(input_ids=left, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, 3:], alone[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(padded[1], alone[1], atol=2e-5, rtol=1e-4)
        for flash_kwargs in (False, True):  # position ids, or host cu_seq_lens (no sync on either)
            collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
            batch = collate([{"input_ids": a.tolist()}, {"input_ids": b.tolist()}])
            batch.pop("labels")
            packed = model(**batch).logits[0]
            torch.testing.assert_close(packed, torch.cat(alone), atol=2e-5, rtol=1e-4)


def test_enable_gradient_checkpointing_errors():
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        ft_hf.enable_gradient_checkpointing(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="either config or"):
        ft_hf.enable_gradient_checkpointing(torch.nn.Linear(2, 2), fastft.OffloadConfig(), min_bytes=0)
    with pytest.raises(TypeError, match="config must be a fastft.OffloadConfig"):
        ft_hf.enable_gradient_checkpointing(torch.nn.Linear(2, 2), "auto")
    model = ft_hf.enable_gradient_checkpointing(tiny("llama", torch.float32).cpu(), min_bytes=0)
    assert model.is_gradient_checkpointing


def test_packed_attention_errors_and_positional_arguments():
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        ft_hf.apply(torch.nn.Linear(2, 2))
    model = ft_hf.apply(tiny("llama", torch.float32).cpu(), offload_checkpointing=False)
    ids = torch.randint(0, 128, (1, 6))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1]])
    with torch.no_grad():  # the model binds positional arguments before the decoder stack's hook sees them
        torch.testing.assert_close(model(ids, mask).logits, model(input_ids=ids, attention_mask=mask).logits)
    with pytest.raises(ValueError, match="as keyword arguments"):
        model.model(ids, mask)
    with pytest.raises(ValueError, match="2D padding attention_mask"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 6, 6))


@pytest.mark.gpu
def test_packed_llama_step_is_sync_free_with_collator_lengths():
    model = ft_hf.apply(tiny("llama", torch.bfloat16), offload_checkpointing=False)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    g = torch.Generator().manual_seed(3)
    batch = collate([{"input_ids": torch.randint(0, 128, (n,), generator=g).tolist()} for n in (40, 7, 81)])
    batch = {
        k: v.cuda() if k in ("input_ids", "labels", "position_ids") else v for k, v in batch.items()
    }  # lengths stay on the host
    model(**batch).loss.backward()  # warm up (allocations, kernel compilation)
    with no_host_sync():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        logits.float().square().mean().backward()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("source", ["position_ids", "broadcast", "none", "cu_seq_lens"])
def test_one_packed_seq_info_per_forward(source, graphs, monkeypatch):
    """The decoder stack's hook builds the batch's PackedSeqInfo once per training forward, also when it pads
    the batch for graphs; every layer reuses it."""
    model = ft_hf.apply(tiny("llama", torch.float32).cpu(), offload_checkpointing=graphs, graphs=graphs)
    built, seen = [], []
    build = fastft.packed_seq_info
    monkeypatch.setattr(ft_attention, "packed_seq_info", lambda **kw: built.append(build(**kw)) or built[-1])
    attention = ft_attention.packed_attention
    monkeypatch.setattr(ft_attention, "packed_attention", lambda *a, **k: seen.append(a[3]) or attention(*a, **k))
    ids = torch.randint(0, 128, (3, 17))  # 17 tokens a row: padded to 18 under graphs
    kwargs = {
        "position_ids": dict(position_ids=torch.arange(17).repeat(3, 1)),
        "broadcast": dict(position_ids=torch.arange(17)[None]),  # [1, T] for a batch of plain rows
        "none": {},
        "cu_seq_lens": dict(
            cu_seq_lens_q=torch.tensor([0, 17, 34, 51]),
            cu_seq_lens_k=torch.tensor([0, 17, 34, 51]),
            max_length_q=17,
            max_length_k=17,
        ),
    }[source]
    if source == "cu_seq_lens" and graphs:  # one row: three rows' documents would be given over the flat batch
        ids = ids.reshape(1, 51)
    model(input_ids=ids, **kwargs)
    assert len(built) == 1 and len(seen) == model.config.num_hidden_layers and all(i is built[0] for i in seen)
    real = built[0].cu_seqlens.tolist()[:4]
    assert real == [0, 17, 34, 51] if not graphs or source == "cu_seq_lens" else real[:2] == [0, 17]
    if graphs:  # padded to the token bucket, the padding its own documents
        assert built[0].num_tokens > ids.numel()


@pytest.mark.parametrize("apply_first", [True, False])
def test_peft_lora_keeps_documents_apart(apply_first):
    peft = pytest.importorskip("peft")
    model = tiny("llama", torch.float32).cpu()
    if apply_first:  # packing only: PEFT's LoRA forward
        model = ft_hf.apply(model, offload_checkpointing=False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    if not apply_first:  # on the PEFT model: packing through its wrapper, and lora_linear
        model = ft_hf.apply(model, offload_checkpointing=False)
    g = torch.Generator().manual_seed(2)
    a, b = torch.randint(1, 128, (5,), generator=g), torch.randint(1, 128, (8,), generator=g)
    with torch.no_grad():
        alone = [model(input_ids=x[None]).logits[0] for x in (a, b)]
        packed = model(
            input_ids=torch.cat([a, b])[None], position_ids=torch.cat([torch.arange(5), torch.arange(8)])[None]
        ).logits[0]
        left = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), a]), b])
        padded = model(input_ids=left, attention_mask=torch.tensor([[0, 0, 0] + [1] * 5, [1] * 8])).logits
    torch.testing.assert_close(packed, torch.cat(alone), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(padded[1], alone[1], atol=2e-5, rtol=1e-4)


def checkpoint_funcs(model):
    """The checkpoint function of each decoder layer that checkpoints."""
    layers = ft_hf.hf_model(model).modules()
    return [
        m._gradient_checkpointing_func
        for m in layers
        if isinstance(m, transformers.GradientCheckpointingLayer) and m.gradient_checkpointing
    ]


def is_fastft_checkpoint(func):
    while isinstance(func, functools.partial):
        func = func.func
    return func in (fastft.offload.gradient_checkpointing_func, fastft.offloaded_checkpoint)


SPELLINGS = [
    name
    for name in ("gradient_checkpointing_enable", "activation_checkpointing_enable")
    if hasattr(transformers.PreTrainedModel, name)  # the second from transformers 5.24
]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_later_gradient_checkpointing_enable_keeps_fastft(wrap, spelling, recwarn):
    model = tiny("llama", torch.float32).cpu()
    if wrap == "peft":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    recwarn.clear()  # PEFT's own (it reads is_gradient_checkpointing, deprecated in transformers 5.24)
    ft_hf.apply(model)
    assert not recwarn.list, [str(w.message) for w in recwarn.list]  # no deprecation warning from apply
    layers = [m for m in ft_hf.hf_model(model).modules() if isinstance(m, transformers.GradientCheckpointingLayer)]
    assert len(layers) == 2 and all(is_fastft_checkpoint(f) for f in checkpoint_funcs(model))
    enable = getattr(model, spelling)
    options = spelling.split("_enable")[0] + "_kwargs"  # gradient_checkpointing_kwargs, activation_...
    # what Trainer, TRL and PEFT call, with every argument transformers takes
    enable()
    enable(**{options: {"use_reentrant": False}}, offload=True)
    assert all(f is fastft.offload.gradient_checkpointing_func for f in checkpoint_funcs(model))
    enable({"preserve_rng_state": False}, every_n_layers=2)
    assert [m.gradient_checkpointing for m in layers] == [True, False]
    (func,) = checkpoint_funcs(model)
    assert is_fastft_checkpoint(func) and func.keywords == {"preserve_rng_state": False}
    assert not recwarn.list, [str(w.message) for w in recwarn.list]
    with pytest.raises(ValueError, match="every_n_layers must be a positive int"):
        enable(every_n_layers=0)
    with pytest.raises(TypeError, match="offload must be a bool"):
        enable(offload="yes")
    with pytest.warns(UserWarning, match="keeps its non-reentrant checkpoint"):
        enable(**{options: {"use_reentrant": True}})
    assert len(checkpoint_funcs(model)) == 2 and all(is_fastft_checkpoint(f) for f in checkpoint_funcs(model))
    model.gradient_checkpointing_disable()
    assert not ft_hf.hf_model(model).is_gradient_checkpointing
    model.gradient_checkpointing_enable()
    assert all(is_fastft_checkpoint(f) for f in checkpoint_funcs(model))


def test_trainer_keeps_fastft_checkpointing(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    model = ft_hf.apply(tiny("llama", torch.float32).cpu())
    calls = []
    real = fastft.offload.offloaded_checkpoint
    monkeypatch.setattr(fastft.offload, "offloaded_checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 128, (n,), generator=g).tolist()} for n in (5, 9, 3, 7)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False, "offload": True},
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    collate = transformers.DataCollatorWithFlattening()
    transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=collate).train()
    assert all(f is fastft.offload.gradient_checkpointing_func for f in checkpoint_funcs(model))
    assert len(calls) == 2 * 2  # two layers, two steps: every layer went through fastft's checkpoint


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_revert_undoes_apply(name):
    peft = pytest.importorskip("peft")
    untouched = tiny(name, torch.float32).cpu()
    targets = ["q_proj", "v_proj"]
    untouched = peft.get_peft_model(untouched, peft.LoraConfig(r=4, target_modules=targets))
    model = peft.get_peft_model(tiny(name, torch.float32).cpu(), peft.LoraConfig(r=4, target_modules=targets))
    model.load_state_dict(untouched.state_dict())
    inner = ft_hf.hf_model(model)
    before = (inner.config._attn_implementation, inner.config._experts_implementation)
    with pytest.raises(ValueError, match="nothing from fastft to revert"):
        ft_hf.revert(model)
    ft_hf.apply(model)
    model.gradient_checkpointing_enable()  # as Trainer would; revert still restores the state before apply
    assert inner.config._attn_implementation == "fastft"
    assert ft_hf.revert(model) is model
    assert (inner.config._attn_implementation, inner.config._experts_implementation) == before
    assert not inner.is_gradient_checkpointing and "gradient_checkpointing_enable" not in inner.__dict__
    assert not getattr(inner, "_require_grads_hooks", None)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in inner.modules())
    assert not any("forward" in m.__dict__ for m in model.modules())
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(untouched, ids)
    torch.testing.assert_close(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], msg=key)
    with pytest.raises(ValueError, match="nothing from fastft to revert"):
        ft_hf.revert(model)
    ft_hf.apply(model)  # and again
    assert inner.config._attn_implementation == "fastft" and inner.is_gradient_checkpointing


def test_revert_keeps_checkpointing_the_model_had():
    model = tiny("llama", torch.float32).cpu()
    model.gradient_checkpointing_enable()
    (before,) = set(checkpoint_funcs(model))
    ft_hf.revert(ft_hf.apply(model))
    assert model.is_gradient_checkpointing and set(checkpoint_funcs(model)) == {before}


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_lora_on_experts_weights_goes_through_fastft_experts(name, monkeypatch, rng):
    """PEFT ``target_parameters`` LoRA on the experts' weights (as MoE fine-tunes train): fastft's experts path
    gives PEFT's own result (transformers' experts loop on the adapted weights), adapters' gradients included."""
    peft = pytest.importorskip("peft")
    seed = int(torch.randint(1 << 30, (), generator=rng))

    def build(moe):
        model = tiny(name, torch.float32).cpu()
        config = peft.LoraConfig(
            r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        )
        model = peft.get_peft_model(model, config)
        torch.manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)  # PEFT starts B at zero: make the adapters matter
        ft_hf.apply(model, moe=moe, offload_checkpointing=False)
        if not moe:
            ft_hf.hf_model(model).set_experts_implementation("eager")
        return model

    ref, model = build(moe=False), build(moe=True)
    calls = []
    real = fastft.experts.routed_experts
    monkeypatch.setattr(fastft.experts, "routed_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(0, 128, (1, 14), generator=rng)
    positions = torch.cat([torch.arange(6), torch.arange(8)])[None]
    model.zero_grad()
    ref.zero_grad()
    loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
    loss.backward()
    assert len(calls) == 2  # one experts block per layer, through fastft
    ref_loss = ref(input_ids=ids, labels=ids, position_ids=positions).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=2e-5, rtol=1e-4)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and sum("experts" in n for n in grads) == 8
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], atol=2e-5, rtol=1e-4, msg=key)


def test_mixed_precision_training_matches_stock_sdpa():
    """fp32 weights under bf16 autocast (Trainer's bf16=True): fastft's attention gets fp32 rotated q/k and a
    bf16 v, computes in bf16 as SDPA does, and matches the stock model."""
    device = "cuda" if GPU else "cpu"
    model = tiny("llama", torch.float32).to(device)
    model.set_attn_implementation("sdpa")
    ids, positions = packed_batch(device)
    with torch.autocast(device, dtype=torch.bfloat16):  # use_cache=False: else stock ignores packed positions
        stock = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
        ft_hf.apply(model, offload_checkpointing=False)
        ours = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
    torch.testing.assert_close(ours, stock, atol=3e-2, rtol=3e-2)


def test_use_expert_parallel_errors():
    model = tiny_hf_model("qwen3_moe")
    with pytest.raises(ValueError, match="call apply"):
        ft_hf.use_expert_parallel(model)
    ft_hf.apply(model)
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            ft_hf.use_expert_parallel(model)
    assert ft_hf.expert_parameters(model) == set()  # nothing was sliced


def test_use_expert_parallel_needs_experts_and_refuses_lora_on_them():
    with pytest.raises(ValueError, match="has no experts blocks"):  # not "call apply first": apply was called
        ft_hf.use_expert_parallel(ft_hf.apply(tiny("llama", torch.float32), offload_checkpointing=False))
    peft = pytest.importorskip("peft")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=experts)
    model = ft_hf.apply(peft.get_peft_model(tiny("qwen3_moe", torch.float32), config), offload_checkpointing=False)
    with pytest.raises(ValueError, match="LoRA on the experts"):  # PEFT's wrapper, not a parametrization
        ft_hf.use_expert_parallel(model)
    assert ft_hf.expert_parameters(model) == set()


@pytest.mark.parametrize("option", ["packing", "offload_checkpointing", "moe", "lora", "graphs"])
def test_apply_options_are_bools(option):
    model = tiny("llama", torch.float32)
    with pytest.raises(TypeError, match=f"{option} must be True.* or .*, got str 'no'"):  # graphs: or 'auto'
        ft_hf.apply(model, **{option: "no"})  # a truthy string turns nothing on
    assert model.config._attn_implementation != "fastft" and not model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="nothing from fastft to revert"):
        ft_hf.revert(model)


@pytest.mark.parametrize(
    "verb", ["revert", "expert_parameters", "use_expert_parallel", "use_packed_attention", "use_moe", "apply"]
)
def test_verbs_take_only_transformers_models(verb):
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel .*, got str"):
        getattr(ft_hf, verb)("model")


def test_revert_runs_each_concerns_undo_last_first():
    model = tiny("qwen3_moe", torch.float32)
    ft_hf.apply(model)
    state = model.__dict__[STATE]
    assert isinstance(state, ModelState) and {"attention", "experts", "checkpointing"} <= state.records.keys()
    order = []
    for i, undo in enumerate(state.undo):
        state.undo[i] = lambda undo=undo, i=i: order.append(i) or undo()
    ft_hf.revert(model)
    assert order == list(range(len(state.undo)))[::-1]
    assert model.config._attn_implementation != "fastft" and not model.is_gradient_checkpointing
