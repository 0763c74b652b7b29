"""The models fastft is measured on: one table of transformers configs (the e2e benchmark, the op
benchmarks' shapes and the real-size GPU tests read it) and the SFT document lengths of their batches."""

from __future__ import annotations

import math

import torch

# name -> (transformers config class, config fields, decoder layers kept on a GPU). The e2e benchmark and the
# real-size GPU tests build them with random weights; the op benchmarks take their shapes from them.
MODEL_CONFIGS = {
    "Llama-3.2-1B": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
        16,
    ),
    "Qwen3-0.6B": (
        "Qwen3Config",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
        28,
    ),
    "Qwen3-8B": (
        "Qwen3Config",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        8,
    ),
    # the seeds' QLoRA model (Unsloth and NVIDIA, May 2026), 20 of its 40 layers: --quant nf4 and the unsloth
    # column each save a bf16 copy (16.7 GB at 20 layers; the GPU machines' 64 GiB disk holds two of 30 GB poorly)
    "Qwen3-14B": (
        "Qwen3Config",
        dict(
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        ),
        20,
    ),
    "Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            intermediate_size=6144,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            vocab_size=151936,
            decoder_sparse_step=1,
        ),
        4,
    ),
    "gpt-oss-20b": (
        "GptOssConfig",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=201088,
            sliding_window=128,
        ),
        4,
    ),
    # Qwen3_5TextConfig's defaults (transformers 5.17), 4 of its 32 layers in its own pattern: 3 Gated DeltaNet
    # (linear attention) layers, then 1 full attention layer
    "Qwen3.5": (
        "Qwen3_5TextConfig",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=32,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=248320,
        ),
        4,
    ),
    # Qwen3_5MoeTextConfig's defaults, 4 of its 40 layers (3 Gated DeltaNet, 1 full attention), every one MoE
    "Qwen3.5-MoE": (
        "Qwen3_5MoeTextConfig",
        dict(
            hidden_size=2048,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            num_hidden_layers=40,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=248320,
        ),
        4,
    ),
}


def sft_lengths(total: int, seed: int = 0, median: int = 380, max_len: int = 4096) -> list[int]:
    """Document lengths, log-normal around ``median`` (sigma 1, as chat SFT sets are), summing to ``total``."""
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        n = int(math.exp(math.log(median) + torch.randn((), generator=g).item()))
        lengths.append(max(16, min(max_len, n)))
    lengths[-1] -= sum(lengths) - total
    return [n for n in lengths if n > 0]


def num_experts(name: str) -> int:
    """Routed experts per MoE layer of the model ``name`` in ``MODEL_CONFIGS``; 0 for a dense model."""
    fields = MODEL_CONFIGS[name][1]
    return fields.get("num_experts", fields.get("num_local_experts", 0))


# MoE routing shapes: name -> (experts, top-k, hidden size); the table's MoE models and two larger routers
MOE_SHAPES = {
    **{
        name: (num_experts(name), fields["num_experts_per_tok"], fields["hidden_size"])
        for name, (_, fields, _) in MODEL_CONFIGS.items()
        if num_experts(name)
    },
    "gpt-oss-120b": (128, 4, 2880),
    "DeepSeek-V3": (256, 8, 7168),
}
