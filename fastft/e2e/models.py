"""The models of the main job: one table of transformers configs, and every fact about a model that the rest of
``fastft.e2e`` asks (MoE or dense, attention sinks, token mixers outside attention, the tiny configs a CPU
runs, the tokens per row). The op benchmarks (``fastft.bench``) take their shapes from the table and the
real-size GPU tests build its models; ``sft_lengths`` gives the SFT document lengths of their batches.
"""

from __future__ import annotations

import argparse
import functools
import math

import torch

# name -> (transformers config class, config fields, decoder layers kept on a GPU unless --layers says otherwise).
# The e2e benchmark and the real-size GPU tests build them with random weights; the op benchmarks take their
# shapes from them.
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
    # the QLoRA model, 20 of its 40 layers by default (--layers all: every one; --quant nf4 and the unsloth column
    # each save a bf16 copy to disk, about 30 GB at 40 layers, one at a time)
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
    # Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B's widths), 4 of its 48 layers (3 Gated DeltaNet, 1 full
    # attention), every one MoE: 512 experts of width 512, top-10, and a shared expert
    "Qwen3-Next": (
        "Qwen3NextConfig",
        dict(
            hidden_size=2048,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=512,
            num_experts_per_tok=10,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=151936,
        ),
        4,
    ),
    # Granite-4.0-H-Tiny (GraniteMoeHybrid): Mamba-2 layers with attention at every tenth (5, 15, 25, 35), a MoE
    # MLP (64 experts of width 512, top-6, a shared MLP of 1024) in every layer; its first 10 layers (9 Mamba-2, 1
    # attention) unless --layers says otherwise. Random weights; no position embedding in its attention layers.
    "Granite-4.0-H-Tiny": (
        "GraniteMoeHybridConfig",
        dict(
            hidden_size=1536,
            intermediate_size=512,
            shared_intermediate_size=1024,
            num_local_experts=64,
            num_experts_per_tok=6,
            num_hidden_layers=40,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=100352,
            mamba_n_heads=48,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_d_conv=4,
            mamba_chunk_size=256,
            layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)],
            position_embedding_type="nope",
            tie_word_embeddings=True,
        ),
        10,
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


TOKENS = {"gpt-oss-20b": 4096}  # tokens per packed row on a GPU; 16,384 for the others
# Tokens per padded micro-batch where it is below the row's: transformers' torch Mamba-2 path (no mamba_ssm on the
# GPU machines) materialises [chunks, 256, 256, heads, state] products, and 16,384 tokens of them run out of
# memory on a 141 GiB card. 4,096: the stream's longest document, alone in its micro-batch.
PADDED_TOKENS = {"Granite-4.0-H-Tiny": 4096}
TINY_TOKENS = 256  # tokens per packed row in the tiny configs
# the tiny configs (CPU, --quick): these fields replace the model's own where it has them, 2 layers
TINY = dict(
    hidden_size=64,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    sliding_window=16,
    shared_expert_intermediate_size=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    shared_intermediate_size=32,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_chunk_size=64,
)


def num_experts(name: str, tiny: bool = False) -> int:
    """Routed experts per MoE layer of the model ``name`` (``tiny``: in its tiny config); 0 for a dense model."""
    fields = MODEL_CONFIGS[name][1]
    key = next((k for k in ("num_experts", "num_local_experts") if k in fields), None)
    if key is None:
        return 0
    return TINY[key] if tiny else fields[key]


def is_moe(name: str) -> bool:
    """Whether the model ``name`` routes its MLP tokens to experts."""
    return num_experts(name) > 0


def has_sinks(name: str) -> bool:
    """gpt-oss: attention sinks, which only transformers' ``eager`` attention takes."""
    return MODEL_CONFIGS[name][0] == "GptOssConfig"


def budget(name: str, tiny: bool) -> int:
    """Tokens per packed row of the model ``name``: 16,384 (gpt-oss 4,096; tiny configs 256)."""
    return TINY_TOKENS if tiny else TOKENS.get(name, 16384)


def padded_budget(name: str, tiny: bool) -> int:
    """Tokens per micro-batch of a padded column (``fastft.e2e.stream.padded``), padding included: the row's
    ``budget``, or less where stock transformers' padded step does not fit it (``PADDED_TOKENS``)."""
    return TINY_TOKENS if tiny else PADDED_TOKENS.get(name, budget(name, tiny))


def full_depth(name: str) -> int:
    """The decoder layers of the released model ``name``."""
    return MODEL_CONFIGS[name][1]["num_hidden_layers"]


def layers_arg(name: str, layers: int | str | None) -> int:
    """The decoder layers the model ``name`` keeps at real size: ``layers`` (an int in [1, its full depth], or
    ``"all"``: its full depth), or the table's count for None; ``ValueError`` naming ``layers`` otherwise."""
    if layers is None:
        return MODEL_CONFIGS[name][2]
    if layers == "all":
        return full_depth(name)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= full_depth(name):
        raise ValueError(f"layers must be an int in [1, {full_depth(name)}] or 'all' for {name}, got {layers!r}")
    return layers


def parse_layers(text: str) -> int | str:
    """``--layers``' value: ``"all"`` or an int (``layers_arg`` checks it against a model);
    ``argparse.ArgumentTypeError`` otherwise."""
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or 'all', got {text!r}") from None


def model_config(name: str, tiny: bool, layers: int | str | None = None):
    """The transformers config of the model ``name`` (``tiny``: 2 layers, small widths; a model of several layer
    kinds keeps one layer of each, in the order its pattern has them: Qwen3.5's Gated DeltaNet, then full
    attention). ``layers``: the decoder layers kept at real size (``layers_arg``; not taken with ``tiny``)."""
    import transformers

    if tiny and layers is not None:
        raise ValueError(f"layers is taken at real size only (the tiny configs keep 2 layers), got {layers!r}")
    config_cls, fields, _ = MODEL_CONFIGS[name]
    config_cls = getattr(transformers, config_cls)
    fields = dict(fields, num_hidden_layers=layers_arg(name, layers))
    if "layer_types" in fields:  # the pattern's first layers
        fields["layer_types"] = fields["layer_types"][: fields["num_hidden_layers"]]
    if tiny:
        kinds = list(dict.fromkeys(getattr(config_cls(**fields), "layer_types", None) or ()))
        fields.update({k: v for k, v in TINY.items() if k in fields}, num_hidden_layers=2)
        if len(kinds) > 1:
            fields.update(num_hidden_layers=len(kinds), layer_types=kinds)
    return config_cls(**fields, use_cache=False)


def dtype_for(device) -> torch.dtype:
    """The models' dtype on ``device``: bf16 on a GPU, fp32 on a CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def mixer_modules(model) -> list[torch.nn.Module]:
    """The token mixers of ``model`` besides attention that fastft makes packing-correct (Gated DeltaNet,
    LFM2's short convolutions: ``mixers.SUPPORTED``)."""
    from fastft.integrations.transformers import mixers

    return [m for m in model.modules() if type(m).__name__ in mixers.SUPPORTED]


def mixes_outside_attention(model) -> bool:
    """Whether layers of ``model`` (a transformers model, or a PEFT wrapper's) mix tokens along the sequence
    outside attention: mixers fastft supports, or any ``packing_blockers`` finds."""
    from fastft.integrations.transformers import packing_blockers

    return bool(mixer_modules(model)) or bool(packing_blockers(model))


@functools.cache
def has_mixers(name: str) -> bool:
    """``mixes_outside_attention`` of the model ``name`` (its tiny config, built on the meta device); False
    without transformers (nothing runs then)."""
    try:
        import transformers
    except ImportError:
        return False
    with torch.device("meta"):
        return mixes_outside_attention(transformers.AutoModelForCausalLM.from_config(model_config(name, True)))


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
