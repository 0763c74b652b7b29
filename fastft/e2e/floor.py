"""The compute floor of a main-job step: the step's model FLOPs at the GPU's measured dense GEMM rate, the time
no stack can beat without doing less math.

Model FLOPs of one training step on a packed row (``step_flops``), counted on the model built from the same
config (on the meta device):

- every ``nn.Linear`` of the model (the decoder's projections, shared experts, routers that are linear layers,
  ``lm_head``): forward and input gradient, 2 x 2 x in x out per token (the frozen base has no weight
  gradient); LoRA r=16 on the main job's targets (``fastft.e2e.stacks.lora_targets``): forward, input and
  weight gradients, 3 x 2 x r x (in + out) per token;
- MoE experts (3-D ``gate_up_proj`` / ``down_proj`` parameters): forward and input gradient of each token's
  ``num_experts_per_tok`` experts;
- softmax attention of every full or sliding-window layer, per document (causal: the pairs each token sees,
  at most the window): 2 x 2 x heads x head dim per pair forward (QK^T and PV), backward twice the forward;
- not counted: recomputation (what the floor leaves out is what checkpointing adds), the linear-attention
  scans of hybrid layers (their projections are counted), norms, activations, the optimizer.

The rate (``gemm_rate``): a dense bf16 GEMM [row budget, hidden] x [hidden, the widest output of the decoder's
linear layers: the dense MLP's width on dense models] on the GPU (``gemm_shape``), measured once per shape and
device. ``with_floor`` adds ``floor_ms`` (the timed steps' mean floor) and
``gemm_tflops`` to a record at real size on a GPU.
"""

from __future__ import annotations

import functools

import torch

from .models import budget, model_config

LORA_RANK = 16  # the main job's LoRA rank (fastft.e2e.stacks)
ATTENTION_KINDS = ("full_attention", "sliding_attention")  # layer kinds with softmax attention


def _meta_model(name: str, layers):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(model_config(name, False, layers))


@functools.cache
def _model_counts(name: str, layers: int | None) -> tuple[float, tuple[tuple[int, int], ...]]:
    """(GEMM FLOPs per token, (window, heads x head dim) per softmax-attention layer; window 0: none) of the
    model ``name`` with ``layers`` decoder layers."""
    from .stacks import lora_targets

    config = model_config(name, False, layers)
    model = _meta_model(name, layers)
    targets = set(lora_targets(model, name))
    per_token = 0.0
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            a, b = module.in_features, module.out_features
            per_token += 4 * a * b
            if path.rsplit(".", 1)[-1] in targets:
                per_token += 6 * LORA_RANK * (a + b)
        experts = [getattr(module, p, None) for p in ("gate_up_proj", "down_proj")]
        if all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in experts):
            per_expert = sum(p[0].numel() for p in experts)
            per_token += 4 * per_expert * config.num_experts_per_tok
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    window = getattr(config, "sliding_window", None) or 0
    windows = [window if kind == "sliding_attention" else 0 for kind in kinds if kind in ATTENTION_KINDS]
    return per_token, tuple((w, width) for w in windows)


def causal_pairs(n: int, window: int = 0) -> int:
    """(query, key) pairs of causal attention over ``n`` tokens, each token seeing at most ``window`` (0: all)."""
    if window <= 0 or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def step_flops(name: str, lengths, layers: int | None = None) -> float:
    """Model FLOPs of one training step of the main job's model ``name`` (``layers``: as ``model_config``'s) on
    a packed row of documents of ``lengths`` (see the module docstring)."""
    per_token, attention = _model_counts(name, layers)
    flops = per_token * sum(lengths)
    for window, width in attention:
        flops += 3 * 4 * width * sum(causal_pairs(n, window) for n in lengths)
    return flops


@functools.cache
def gemm_rate(device: torch.device, m: int, k: int, n: int) -> float:
    """FLOP/s of a dense bf16 GEMM [m, k] x [k, n] on the CUDA ``device`` (the best of 5 timings of 10 each)."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    with torch.cuda.device(device):
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                a @ b
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / 10)
    return 2 * m * k * n / best


@functools.cache
def gemm_shape(name: str) -> tuple[int, int, int]:
    """The dense GEMM whose rate is the floor's for the model ``name``: [its row budget, hidden] x [hidden, the
    widest output of its decoder's linear layers] (the dense MLP's on dense models)."""
    from fastft.integrations.transformers import decoder_layers

    model = _meta_model(name, 1)
    linears = [m for layer in decoder_layers(model) for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    return budget(name, False), model.config.hidden_size, max(m.out_features for m in linears)


def rate_for(name: str, device) -> float:
    """``gemm_rate`` of the model ``name``'s ``gemm_shape``."""
    return gemm_rate(torch.device(device), *gemm_shape(name))


def with_floor(row: dict, name: str, batches: list, warmup: int, device, tiny: bool, layers=None) -> dict:
    """``row`` (a main-job record of ``batches`` after ``warmup``) with ``floor_ms``, the mean compute floor of its
    timed steps, and ``gemm_tflops``, the rate it is at: on a GPU at real size; None for both otherwise."""
    device = torch.device(device)
    if tiny or device.type != "cuda":
        return {**row, "floor_ms": None, "gemm_tflops": None}
    rate = rate_for(name, device)
    timed = batches[warmup:]
    floor_s = sum(step_flops(name, b.seq_lengths, layers) for b in timed) / rate / len(timed)
    return {**row, "floor_ms": floor_s * 1e3, "gemm_tflops": rate / 1e12}
