"""Benchmark for fastft.lora: one PEFT LoRA linear layer (fp32 adapters, PEFT's default, on bf16
activations), forward + backward, with PEFT's forward and with ``lora_linear``; the frozen base layer
alone is the floor."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastft.e2e.models import MODEL_CONFIGS

from .common import Row, time_ms


def _projection(name: str, proj: str) -> tuple[int, int]:
    """(in features, out features) of a model's ``proj`` layer, from the model table."""
    f = MODEL_CONFIGS[name][1]
    hidden, inter, q = f["hidden_size"], f["intermediate_size"], f["num_attention_heads"] * f["head_dim"]
    return {"q_proj": (hidden, q), "gate_proj": (hidden, inter), "down_proj": (inter, hidden)}[proj]


# name -> (in features, out features), rank 16
SHAPES = {
    f"{name} {proj}": _projection(name, proj)
    for name, proj in (("Qwen3-0.6B", "gate_proj"), ("Llama-3.2-1B", "q_proj"), ("Qwen3-8B", "down_proj"))
}


def run(device: torch.device, quick: bool) -> list[Row]:
    try:
        import peft
    except ImportError:
        print("peft is not installed: skipping the LoRA benchmark")
        return []
    from fastft.integrations import peft as ft_peft

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = 16384 if gpu and not quick else 64
    rows = []
    for name, (fan_in, fan_out) in SHAPES.items():
        if not gpu:
            fan_in, fan_out = fan_in // 64, fan_out // 64
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out, bias=False)).to(device, dtype)
        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=["0"]))
        layer = model.base_model.model[0]
        x = torch.randn(tokens, fan_in, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(tokens, fan_out, device=device, dtype=dtype)

        def step():
            layer(x).backward(grad)

        def base():
            F.linear(x, layer.base_layer.weight).backward(grad)

        peft_ms = time_ms(step, device, rep_ms=300 if gpu else 50)
        ft_peft.use_lora(model)
        ours_ms = time_ms(step, device, rep_ms=300 if gpu else 50)
        floor_ms = time_ms(base, device, rep_ms=300 if gpu else 50)
        shape = f"{name}, {tokens} tokens ({fan_in} -> {fan_out}, r=16), fwd+bwd"
        rows.append(
            Row(
                "lora_linear",
                shape,
                "PEFT LoRA forward",
                peft_ms,
                ours_ms,
                "torch (cuBLAS)",
                f"frozen base linear alone {floor_ms:.3f} ms",
            )
        )
        del model, layer, x
    return rows
