"""Benchmark for the experts op (``fastft.experts.routed_experts``) inside a real transformers MoE experts block,
forward + backward, with transformers' own experts implementations and with fastft's (``use_moe``'s path:
``fastft.swiglu`` as the gate); fastft's path with the block's own gate in torch ops (the chain before
``fastft.swiglu``: permute, grouped GEMM, gate, grouped GEMM, combine); and with PEFT ``target_parameters``
LoRA (r=16) on its weights: PEFT's forward (``W + scaling B A`` formed for every expert, then fastft's experts
path) against fastft's low-rank grouped GEMMs (``use_lora``), time and peak memory (the weights frozen, as in
LoRA fine-tuning). The low-rank add alone (``fastft.experts.grouped_lowrank_add``, the adapter's second
product added to the base GEMM's rows) against the grouped GEMM of that product plus an add, on each
projection's rows, beside the HBM floor (one read and one write of the rows)."""

from __future__ import annotations

from unittest import mock

import torch

from .common import Row, copy_gbs, peak_gib, time_ms

LORA_RANK = 16

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
    "Qwen3.5-MoE": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeExperts",
        dict(hidden_size=2048, moe_intermediate_size=512, num_experts=256, num_experts_per_tok=8),
    ),
}
TINY = {
    "Qwen3-30B-A3B": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "Qwen3.5-MoE": dict(hidden_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2),
}


def run(device: torch.device, quick: bool) -> list[Row]:
    try:
        import transformers
        from transformers.models.gpt_oss import modeling_gpt_oss
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
        from transformers.models.qwen3_moe import modeling_qwen3_moe
    except ImportError:
        print("transformers is not installed: skipping the transformers MoE experts benchmark")
        return []
    import fastft.integrations.transformers as ft_hf
    from fastft import dispatch, routing
    from fastft.integrations.transformers import experts as ft_experts

    ft_hf.register()
    modules = {
        "Qwen3MoeExperts": modeling_qwen3_moe,
        "GptOssExperts": modeling_gpt_oss,
        "Qwen3_5MoeExperts": modeling_qwen3_5_moe,
    }
    gpu = device.type == "cuda"
    backend = dispatch.backend_for(routing.OP_ROUTE, device)
    dtype = torch.bfloat16 if gpu else torch.float32
    tokens = 16384 if gpu and not quick else 64
    rows = []
    shapes = SHAPES if gpu else {"gpt-oss-20b": SHAPES["gpt-oss-20b"]}  # the interpreter: one shape (biases, clamp)
    for name, (config_cls, experts_cls, fields) in shapes.items():
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

        times, peaks = {}, {}
        for impl in ("eager", "grouped_mm", ft_hf.EXPERTS_IMPLEMENTATION):
            config._experts_implementation = impl
            times[impl] = time_ms(step, device, rep_ms=500 if gpu else 50)
            peaks[impl] = peak_gib(step, device)
        own_gate = experts._apply_gate if experts.has_gate else experts.act_fn
        with mock.patch.object(ft_experts, "gate_activation", lambda block: own_gate):  # the chain before swiglu
            times["own gate"] = time_ms(step, device, rep_ms=500 if gpu else 50)
            peaks["own gate"] = peak_gib(step, device)
        shape = f"{name} experts, {tokens} tokens (E={e}, K={k}, H={h}), fwd+bwd"
        baselines = {
            "eager": "transformers eager",
            "grouped_mm": "transformers grouped_mm",
            "own gate": "fastft's path, the block's own gate (torch ops)",
        }
        for impl, label in baselines.items():
            note = "" if peaks[impl] is None else f"peak {peaks['fastft']:.2f} GiB vs {peaks[impl]:.2f} GiB"
            rows.append(Row("transformers MoE experts", shape, label, times[impl], times["fastft"], backend, note))
        rows += _lora_rows(experts, x, ids, weights, shape, backend, device, 500 if gpu else 50)
        rows += _lowrank_rows(name, e, tokens * k, fields, device, dtype, 500 if gpu else 50)
        del experts, x
    return rows


def _lowrank_rows(name, num_experts, pairs, fields, device, dtype, rep_ms) -> list[Row]:
    """``grouped_lowrank_add`` on the gate-up and down rows of one step's routed pairs (balanced experts)."""
    from fastft import dispatch
    from fastft.experts import OP_LOWRANK_ADD, grouped_linear, grouped_lowrank_add

    inter = fields.get("moe_intermediate_size", fields.get("intermediate_size"))
    ends = torch.linspace(0, pairs, num_experts + 1, device=device)[1:].round().to(torch.int32)
    gbs = copy_gbs(device)
    rows = []
    for label, width in (("gate-up", 2 * inter), ("down", fields["hidden_size"])):
        y = torch.randn(pairs, width, device=device, dtype=dtype)
        u = torch.randn(pairs, LORA_RANK, device=device, dtype=dtype)
        b = torch.randn(num_experts, width, LORA_RANK, device=device, dtype=dtype)
        ours = time_ms(lambda: grouped_lowrank_add(y, u, b.transpose(1, 2), ends), device, rep_ms=rep_ms)
        theirs = time_ms(lambda: y + grouped_linear(u, b, ends, False), device, rep_ms=rep_ms)
        floor = "" if gbs is None else f"{ours / (2 * y.numel() * y.element_size() / gbs / 1e6):.2f}x the HBM floor"
        shape = f"{name} {label} rows: {pairs} x {width}, r={LORA_RANK}, E={num_experts}"
        backend = dispatch.backend_for(OP_LOWRANK_ADD, device)
        rows.append(Row("grouped_lowrank_add", shape, "grouped GEMM of u B^T, then add", theirs, ours, backend, floor))
    return rows


def _lora_rows(experts, x, ids, weights, shape, backend, device, rep_ms) -> list[Row]:
    """One experts block (on fastft's experts path) with PEFT LoRA on ``gate_up_proj`` and ``down_proj``:
    PEFT's forward against ``fastft.integrations.peft.use_lora``'s, weights frozen, adapters training; and
    fastft's block without LoRA, weights frozen too (the step LoRA is added to)."""
    try:
        import peft
    except ImportError:
        print("peft is not installed: skipping the LoRA-on-experts rows")
        return []
    from fastft.integrations import peft as ft_peft

    experts.requires_grad_(False)
    plain_ms = time_ms(lambda: experts(x, ids, weights).float().square().mean().backward(), device, rep_ms=rep_ms)
    holder = torch.nn.Module()
    holder.experts = experts
    config = peft.LoraConfig(
        r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_parameters=["experts.gate_up_proj", "experts.down_proj"]
    )
    peft.inject_adapter_in_model(config, holder)
    with torch.no_grad():
        for n, p in holder.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)  # PEFT starts B at zero

    def step():
        holder.experts(x, ids, weights).float().square().mean().backward()
        holder.zero_grad(set_to_none=True)

    try:
        peft_ms, peft_peak = time_ms(step, device, rep_ms=rep_ms), peak_gib(step, device)
    except torch.OutOfMemoryError:
        peft_ms = peft_peak = None
    ft_peft.use_lora(holder)
    ours_ms, ours_peak = time_ms(step, device, rep_ms=rep_ms), peak_gib(step, device)
    ft_peft.revert_lora(holder)
    note = f"r={LORA_RANK}; fastft without LoRA (frozen weights) {plain_ms:.3f} ms, x{ours_ms / plain_ms:.2f} with"
    if ours_peak is not None:
        note += f"; peak {ours_peak:.2f} GiB vs " + ("out of memory" if peft_peak is None else f"{peft_peak:.2f} GiB")
    return [Row("MoE experts + LoRA on experts", shape, "PEFT's forward (W + B A)", peft_ms, ours_ms, backend, note)]
