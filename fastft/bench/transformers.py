"""Benchmark for fastft.integrations.transformers: one MoE experts block of a real transformers model,
forward + backward, with transformers' own experts implementations and with fastft's."""

from __future__ import annotations

import torch

from .common import Row, time_ms

# name -> (config class, experts class, config fields)
SHAPES = {
    "Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        "Qwen3MoeExperts",
        dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        "GptOssExperts",
        dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4),
    ),
}
TINY = {
    "Qwen3-30B-A3B": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
}


def run(device: torch.device, quick: bool) -> list[Row]:
    try:
        import transformers
        from transformers.models.gpt_oss import modeling_gpt_oss
        from transformers.models.qwen3_moe import modeling_qwen3_moe
    except ImportError:
        print("transformers is not installed: skipping the transformers MoE experts benchmark")
        return []
    import fastft.integrations.transformers as ft_hf
    from fastft import dispatch, routing

    ft_hf.register()
    modules = {"Qwen3MoeExperts": modeling_qwen3_moe, "GptOssExperts": modeling_gpt_oss}
    gpu = device.type == "cuda"
    backend = dispatch.backend_for(routing.OP_ROUTE, device)
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = 16384 if gpu and not quick else 64
    rows = []
    for name, (config_cls, experts_cls, fields) in SHAPES.items():
        fields = TINY[name] if tokens == 64 else fields
        config = getattr(transformers, config_cls)(**fields)
        torch.manual_seed(0)
        experts = getattr(modules[experts_cls], experts_cls)(config).to(device, dtype)
        with torch.no_grad():
            for p in experts.parameters():
                p.normal_(0, 0.02)
        e, k, h = experts.num_experts, config.num_experts_per_tok, fields["hidden_size"]
        x = torch.randn(tokens, h, device=device, dtype=dtype, requires_grad=True)
        logits = torch.randn(tokens, e, device=device)
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        weights = weights.to(dtype).requires_grad_()

        def step():
            experts(x, ids, weights).float().square().mean().backward()

        times = {}
        for impl in ("eager", "grouped_mm", ft_hf.EXPERTS_IMPLEMENTATION):
            config._experts_implementation = impl
            times[impl] = time_ms(step, device, rep_ms=500 if gpu else 50)
        shape = f"{name} experts, {tokens} tokens (E={e}, K={k}, H={h}), fwd+bwd"
        for impl in ("eager", "grouped_mm"):
            rows.append(
                Row("transformers MoE experts", shape, f"transformers {impl}", times[impl], times["fastft"], backend)
            )
        del experts, x
    return rows
