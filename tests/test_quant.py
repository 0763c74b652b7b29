"""QLoRA: ``--quant nf4`` in the main job (``fastft.e2e.quant``) and ``apply`` on models with
bitsandbytes 4-bit layers.

The tests that load 4-bit models need bitsandbytes (CPU 4-bit layers since 0.45; CI does not install it, so
they are skipped there); the others run everywhere."""

import importlib.util

import pytest
import torch

import fastft
import fastft.integrations.transformers as ft_hf
from fastft.e2e import quant, report, stacks
from fastft.e2e import run as e2e_run
from fastft.testing import tiny_hf_model

pytest.importorskip("transformers")

GPU = torch.cuda.is_available()
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (pip install bitsandbytes; not in CI)")
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")


def bnb_layers(model) -> list[str]:
    """The names of ``model``'s bitsandbytes layers (a PEFT LoRA layer's base layer among them)."""
    return [n for n, m in model.named_modules() if type(m).__module__.partition(".")[0] == "bitsandbytes"]


# ---- without bitsandbytes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["int4", "NF4", 4, True])
def test_bad_quant_values_are_value_errors_naming_quant(bad):
    with pytest.raises(ValueError, match="quant must be None or one of 'none', 'nf4'"):
        quant.quant_arg(bad)
    with pytest.raises(ValueError, match="quant must be"):
        e2e_run.run(torch.device("cpu"), True, models=["Qwen3-0.6B"], only_columns=["fastft"], quant=bad)
    with pytest.raises(ValueError, match="quant must be"):
        e2e_run.describe(torch.device("cpu"), True, quant=bad)
    with pytest.raises(ValueError, match="quant must be"):
        stacks.build("Qwen3-0.6B", "fastft", torch.device("cpu"), True, quant=bad)
    assert quant.quant_arg(None) is None and quant.quant_arg("none") is None and quant.quant_arg("nf4") == "nf4"


def test_describe_says_what_is_quantized():
    cpu = torch.device("cpu")
    text = e2e_run.describe(cpu, True, quant="nf4")
    assert "quant nf4 (QLoRA)" in text and "double quantization" in text and "MoE experts stay bf16" in text
    assert "nf4" not in e2e_run.describe(cpu, True) and "nf4" not in e2e_run.describe(cpu, True, quant="none")


@pytest.mark.parametrize(
    "args",
    [
        ("e2e", "--quant", "nf4", "--model", "Qwen3-0.6B"),
        ("audit", "--quant", "nf4"),
    ],
)
def test_quant_without_gpu_or_bitsandbytes_is_a_usage_error(args, capsys, monkeypatch):
    from fastft.__main__ import main

    if GPU:  # the other half: no bitsandbytes
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(SystemExit) as exit:
        main(list(args))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.startswith("usage: python -m fastft "), err
    expected = "--quant nf4 needs bitsandbytes" if GPU else "--quant nf4 needs a GPU"
    assert expected in err and "Traceback" not in err, err


def test_quant_usage_errors(capsys):
    from fastft.__main__ import main

    for args, message in [
        (("e2e", "--quant", "int8"), "invalid choice: 'int8' (choose from 'none', 'nf4')"),
        (("bench", "--quant", "nf4"), "unrecognized arguments: --quant nf4"),
        (("e2e", "--nproc", "2", "--quant", "nf4"), "--quant is not taken with --nproc"),
    ]:
        with pytest.raises(SystemExit) as exit:
            main(list(args))
        err = capsys.readouterr().err
        assert exit.value.code == 2 and message in err, err


def test_why_unavailable_names_what_is_missing(monkeypatch):
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    assert quant.why_unavailable(None, torch.device("cpu")) is None
    assert "needs a GPU" in quant.why_unavailable("nf4", torch.device("cpu"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    assert quant.why_unavailable("nf4", cuda).startswith("needs bitsandbytes (pip install bitsandbytes;")


# ---- with bitsandbytes (4-bit layers on the CPU here, CUDA on a GPU) -----------------------------------------


def four_bit(family: str, dtype=torch.float32):
    """A tiny ``family`` model in bitsandbytes 4-bit NF4 (``fastft.e2e.quant.quantized``), on the device."""
    model = quant.quantized(tiny_hf_model(family, dtype, "cuda" if GPU else "cpu"), "nf4")
    layers = bnb_layers(model)
    assert layers and all(type(m).__name__ == "Linear4bit" for n, m in model.named_modules() if n in layers)
    assert all(
        type(p).__name__ == "Params4bit" and p.dtype == torch.uint8
        for n, p in model.named_parameters()
        if "proj" in n and "experts" not in n
    )
    return model


def sum_objective(model, **batch):
    """Logits and a loss that is a sum over tokens (so the packed row's gradient is the documents' sum)."""
    logits = model(**batch).logits
    return logits.detach(), logits.float().square().sum() / 1000


LENGTHS = [5, 9, 3, 11]  # one packed row; the longest documents pass tiny qwen3's 6-token sliding window


@needs_bnb
@needs_peft
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_packed_qlora_step_matches_stock_on_each_document_alone(family, grads_close):
    """apply on a 4-bit PEFT model (LoRA on every 4-bit projection, and on the experts' weights): the packed
    row's logits and LoRA gradients equal each document alone, through fastft's path and (fp32, CPU) stock
    transformers + PEFT's forward; the 4-bit LoRA layers take fastft's ``lora_linear`` (the base dequantized in
    forward and backward), the experts' LoRA fastft's experts path. In bf16 fastft's adapters round to bf16
    where PEFT's stay fp32: ``test_4bit_lora_layer_error_against_fp32`` compares the two there."""
    import peft
    from peft.tuners.lora.bnb import Linear4bit as PeftLinear4bit

    dtype = torch.bfloat16 if GPU else torch.float32
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=2e-5, rtol=1e-4)
    model = four_bit(family, dtype)
    moe = family == "qwen3_moe"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj", "up_proj", "down_proj"])
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if moe else None
    config = peft.LoraConfig(r=4, target_modules=targets, target_parameters=experts, init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    lora_4bit = [m for m in model.modules() if isinstance(m, PeftLinear4bit)]
    assert len(lora_4bit) == 2 * len(targets)
    if moe:
        model.base_model.model.set_experts_implementation("eager")

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=g).to(model.device)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None].to(model.device)

    def each_document_alone():
        logits, start = [], 0
        model.zero_grad(set_to_none=True)
        for n in LENGTHS:
            doc_logits, loss = sum_objective(model, input_ids=ids[:, start : start + n])
            loss.backward()
            logits.append(doc_logits)
            start += n
        return torch.cat(logits, dim=1), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    stock_logits, stock_grads = each_document_alone()  # stock transformers (sdpa) + PEFT's forward
    assert stock_grads and all("lora_" in n for n in stock_grads)

    ft_hf.apply(model)  # packing, offloaded checkpointing, MoE, LoRA
    assert model.config._attn_implementation == "fastft"
    assert fastft.integrations.peft.has_lora(model)
    assert all("forward" in m.__dict__ for m in lora_4bit)  # fastft's forward, on every 4-bit LoRA layer
    if moe:
        assert model.base_model.model.config._experts_implementation == "fastft"
        assert any(type(m).__name__ == "ParamWrapper" and "forward" in m.__dict__ for m in model.modules())
    alone_logits, alone_grads = each_document_alone()
    model.zero_grad(set_to_none=True)
    logits, loss = sum_objective(model, input_ids=ids, position_ids=positions)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    references = [(alone_logits, alone_grads)] + ([(stock_logits, stock_grads)] if dtype == torch.float32 else [])
    for ref_logits, ref_grads in references:
        torch.testing.assert_close(logits, ref_logits, **tol)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            grads_close(grad, ref_grads[name], **tol, msg=name)


@needs_bnb
@needs_peft
def test_4bit_lora_layer_error_against_fp32(rng):
    """One PEFT LoRA layer on a 4-bit base, fastft's forward against PEFT's: against the fp32 product of the
    dequantized weight and fp32 adapters, fastft's output and gradients (input, A, B) are within twice PEFT's
    error plus about two roundings of the activations' dtype (bf16 on a GPU, fp32 on the CPU)."""
    import bitsandbytes.functional as bnb_f
    import peft

    dtype = torch.bfloat16 if GPU else torch.float32
    slack = 8e-3 if dtype == torch.bfloat16 else 1e-5
    model = peft.get_peft_model(
        four_bit("llama", dtype), peft.LoraConfig(r=8, target_modules=["q_proj"], init_lora_weights=False)
    )
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base, a, b, scaling = layer.base_layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight, 2.0
    layer.scaling["default"] = scaling
    x0 = torch.randn(2, 24, base.in_features, generator=rng).to(model.device, dtype)
    grad = torch.randn(2, 24, base.out_features, generator=rng).to(model.device, dtype)

    def run(forward, x, weight, lora_a, lora_b):
        x = x.detach().requires_grad_()
        for t in (lora_a, lora_b):
            t.grad = None
        y = forward(x, weight, lora_a, lora_b)
        y.backward(grad.to(y.dtype))
        return [t.float() for t in (y.detach(), x.grad, lora_a.grad, lora_b.grad)]

    w32 = bnb_f.dequantize_4bit(base.weight.data, base.weight.quant_state).float()
    a32, b32 = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    reference = run(lambda x, w, la, lb: x @ w.T + scaling * (x @ la.T) @ lb.T, x0.float(), w32, a32, b32)
    theirs = run(lambda x, w, la, lb: layer(x), x0, None, a, b)  # PEFT's forward
    fastft.integrations.peft.use_lora(model)
    assert "forward" in layer.__dict__
    ours = run(lambda x, w, la, lb: layer(x), x0, None, a, b)
    for what, ref, o, t in zip(("output", "input grad", "A grad", "B grad"), reference, ours, theirs):
        err_ours, err_theirs = ((v - ref).norm() / ref.norm() for v in (o, t))
        assert err_ours <= 2 * err_theirs + slack, (what, float(err_ours), float(err_theirs))


@needs_bnb
def test_quantized_keeps_the_weights_outside_the_4bit_layers():
    import bitsandbytes.functional as bnb_f

    reference = tiny_hf_model("llama")
    model = quant.quantized(lambda: tiny_hf_model("llama"), "nf4", key="test")
    again = quant.quantized(lambda: pytest.fail("built again"), "nf4", key="test")  # loaded from the saved copy
    weights = dict(reference.named_parameters())
    for m in (model, again):
        assert m.training and m.is_loaded_in_4bit
        layer = m.model.layers[1].mlp.down_proj
        state = layer.weight.quant_state
        assert state.quant_type == "nf4" and state.nested and state.blocksize == 64
        dequantized = bnb_f.dequantize_4bit(layer.weight.data, state)  # within NF4's step of the original
        original = weights["model.layers.1.mlp.down_proj.weight"]
        assert (dequantized - original).abs().max() <= 0.2 * original.abs().max()
        for name, p in m.named_parameters():
            if type(p).__name__ != "Params4bit":
                torch.testing.assert_close(p, weights[name], atol=0, rtol=0, msg=name)
    assert "lm_head" not in bnb_layers(model)


@needs_bnb
@needs_peft
def test_e2e_runs_qlora_columns_and_records_quant(device):
    records = e2e_run.run(
        device,
        True,
        models=["Qwen3-0.6B"],
        only_columns=["stock sdpa", "fastft"],
        quant="nf4",
        warmup=1,
        steps=1,
    )
    assert [r["column"] for r in records] == ["stock sdpa", "fastft"]
    assert all(r["quant"] == "nf4" and r["lora"] for r in records)
    ok, text = report.loss_check(records)
    assert ok and "'fastft'" in text, text


@pytest.mark.gpu
@needs_bnb
@needs_peft
def test_4bit_layers_replayed_as_cuda_graphs_match_eager(grads_close):
    """``apply(graphs=True)`` on a 4-bit PEFT model captures its layers (bitsandbytes' dequantize and matmul
    among them) and gives eager's losses and LoRA gradients on three packed batches of different signatures."""
    import peft

    results = []
    for graphed in (False, True):
        model = four_bit("qwen3", torch.bfloat16)
        torch.manual_seed(1)
        targets = ["q_proj", "v_proj", "down_proj"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False))
        ft_hf.apply(model, graphs=graphed)
        before, steps = fastft.graphs.capture_count(), []
        for seed, lengths in enumerate([[40, 24], [30, 20, 14], [50, 14]]):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, 128, (1, 64), generator=g).cuda()
            positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
            loss.backward()
            steps.append(
                (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            )
        assert (fastft.graphs.capture_count() > before) == graphed  # replayed, not fallen back to eager
        results.append(steps)
    for (loss_e, grads_e), (loss_g, grads_g) in zip(*results):
        torch.testing.assert_close(loss_g, loss_e, atol=2e-2, rtol=2e-2)
        assert grads_g.keys() == grads_e.keys() and grads_e
        for name in grads_e:
            grads_close(grads_g[name], grads_e[name], atol=3e-2, rtol=3e-2, msg=name)
