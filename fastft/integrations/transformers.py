"""Hugging Face transformers integration: packed-sequence attention, offloaded checkpointing and MoE
experts blocks from fastft, through transformers' own registries (no model code copied or edited).

    from fastft.integrations.transformers import apply
    model = apply(model)   # packing=True, offload_checkpointing=True, moe=True

- ``use_packed_attention(model)``: attention function ``"fastft"`` (transformers' attention registry):
  document boundaries from ``position_ids`` (e.g. ``DataCollatorWithFlattening``) or the collator's
  ``cu_seq_lens_q`` + ``max_length_q``, built once per forward as a ``PackedSeqInfo`` and reused by
  every layer; no document attends to another; each layer's sliding window is honoured.
- ``use_moe(model)``: experts implementation ``"fastft"`` (transformers' experts registry), see
  ``experts_forward``.
- offload: ``enable_gradient_checkpointing`` (``fastft.offloaded_checkpoint`` as the checkpoint function).
- LoRA: PEFT LoRA linear layers through ``fastft.lora.lora_linear`` (``fastft.integrations.peft``).

transformers (5.x; tested with 5.17) is imported only by the functions here.
"""

from __future__ import annotations

import functools

import torch

from .. import capabilities
from ..attention import packed_attention
from ..offload import OffloadConfig, gradient_checkpointing_func, offloaded_checkpoint
from ..packing import packed_seq_info
from ..routing import moe_expert_rows, moe_permute, moe_route, moe_unpermute

EXPERTS_IMPLEMENTATION = "fastft"
ATTENTION_IMPLEMENTATION = "fastft"


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x`` times expert ``e``'s matrix: ``weight[e]`` (``[in, out]``) when
    ``transposed``, else ``weight[e].T`` (``weight`` is ``[E, out, in]``). ``torch._grouped_mm`` where it
    runs (CUDA bf16, aligned sizes; no host sync); otherwise one matmul per expert, which reads ``ends``
    on the host."""
    w = weight if transposed else weight.transpose(-2, -1)
    if capabilities.grouped_mm(x, weight):
        return torch._grouped_mm(x, w, offs=ends)
    starts = [0] + ends.tolist()
    rows = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, starts[1:]))]
    return torch.cat(rows + [x.new_zeros(x.shape[0] - starts[-1], w.shape[-1])])  # padding rows: 0


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A transformers experts block's forward with fastft routing: ``moe_route`` (no host sync) ->
    ``moe_permute`` -> grouped up/gate projection, gate, grouped down projection (+ per-expert biases
    through ``moe_expert_rows``) -> ``moe_unpermute`` weighted by the router (fp32 sum in fixed order).
    Expert ids outside ``[0, num_experts)`` (expert-parallel sentinels) contribute nothing."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    num_experts = up.shape[0]
    tokens, top_k = top_k_index.shape
    weights = top_k_weights
    if weights.shape == (tokens, num_experts) and top_k != num_experts:  # routers that return every expert's weight
        weights = weights.gather(1, top_k_index.long().clamp(0, num_experts - 1))
    routing = moe_route(top_k_index, num_experts)
    ends = routing.offsets[1:]
    h = grouped_linear(moe_permute(hidden_states, routing), up, ends, self.is_transposed)
    if self.has_bias:
        h = h + moe_expert_rows(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias, routing)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    out = grouped_linear(h, self.down_proj, ends, self.is_transposed)
    if self.has_bias:
        out = out + moe_expert_rows(self.down_proj_bias, routing)
    return moe_unpermute(out, routing, weights).to(hidden_states.dtype)


def register() -> None:
    """Register ``experts_forward`` with transformers as the experts implementation ``"fastft"``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def use_moe(model):
    """Route every experts block of a transformers model through fastft (see ``experts_forward``); returns
    the model."""
    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel with experts blocks, got {type(model).__name__}")
    if not has_experts(model):
        raise ValueError(
            f"{type(model).__name__} has no transformers experts blocks (use_experts_implementation) to route"
        )
    register()
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model


# ---- packed-sequence attention --------------------------------------------------------------------------

PACKED_INFO_KWARG = "fastft_packed_info"  # the forward keyword that hands each layer the batch's PackedSeqInfo


def _batch_info(batch: int, tokens: int, device, kwargs: dict):
    """The ``PackedSeqInfo`` of a ``[batch, tokens]`` batch from the model call's keyword arguments."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # flash kwargs of DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        max_len = kwargs.get("max_length_q")
        return packed_seq_info(
            cu_seqlens=cu,
            max_seqlen=int(max_len) if max_len is not None else None,
            num_tokens=batch * tokens,
            device=device,
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return packed_seq_info(seq_lengths=[tokens] * batch, device=device)
    if position_ids.dim() == 2 and position_ids.shape[0] != batch:  # [1, T] for a batch of plain rows
        position_ids = position_ids.expand(batch, -1)
    return packed_seq_info(position_ids=position_ids, device=device)


def attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers attention function ``"fastft"``: ``fastft.packed_attention`` (causal attention inside
    each document only) with the layer's window, scale, dropout and attention sinks (gpt-oss).

    ``query`` is ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, T, D]``; returns (``[B, T, H, D]``, None).
    The ``PackedSeqInfo`` comes from the decoder stack's pre-hook (built once per forward, see
    ``use_packed_attention``), or from the layer's own ``position_ids`` / ``cu_seq_lens_q`` when the layer is
    called without that hook.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            "fastft packed attention needs keys for exactly the query tokens (training or prefill, no KV cache)"
        )
    info = kwargs.get(PACKED_INFO_KWARG)
    if info is None:
        info = _batch_info(query.shape[0], query.shape[2], query.device, kwargs)
    window = int(sliding_window) if sliding_window else None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = packed_attention(
        q, k, v, info, window=window, sinks=getattr(module, "sinks", None), scale=scaling, dropout_p=dropout
    )
    return out, None


def _prepare_packed_batch(module, args, kwargs):
    """Forward pre-hook of the decoder stack, once per forward: a 2D ``attention_mask`` (padding) becomes
    position ids whose padding tokens are one-token documents (no sync), since transformers passes no mask
    to a registered attention function; then the batch's ``PackedSeqInfo`` is built once and handed to
    every layer under ``PACKED_INFO_KWARG``."""
    if len(args) > 1:
        raise ValueError("with fastft packed attention, pass attention_mask and position_ids as keyword arguments")
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("fastft packed attention takes a 2D padding attention_mask (or none), not a prepared mask")
        keep = mask.bool()
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = keep.long().cumsum(-1) - 1
        kwargs = {**kwargs, "attention_mask": None, "position_ids": torch.where(keep, positions, 0)}
    ids = args[0] if args else kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    if tokens is None or kwargs.get("past_key_values") is not None:
        return args, kwargs  # nothing to describe, or generation with a cache: each layer decides
    batch, length = tokens.shape[:2]
    info = _batch_info(batch, length, tokens.device, kwargs)
    return args, {**kwargs, PACKED_INFO_KWARG: info}


def _decoder_stack(model):
    """The transformers module whose forward takes ``input_ids``/``position_ids`` and calls the layers."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's wrapper
    return getattr(inner, "base_model", inner)


def use_packed_attention(model):
    """Attention through ``attention_forward`` for every layer of a transformers model; returns the model.

    A 2D padding ``attention_mask`` still works: its padding tokens become documents of their own (position
    ids restart there, which shifts rotary positions of left-padded rows by a constant)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, attention_forward)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    stack = _decoder_stack(model)
    if not getattr(stack, "_fastft_packed_hook", False):
        stack.register_forward_pre_hook(_prepare_packed_batch, with_kwargs=True)
        stack._fastft_packed_hook = True
    return model


# ---- offloaded gradient checkpointing ---------------------------------------------------------------------


def enable_gradient_checkpointing(model, config: OffloadConfig | None = None, **config_fields):
    """Turn on a transformers model's gradient checkpointing with offloaded checkpoints; returns the model.

    ``model.gradient_checkpointing_enable()`` (which also makes PEFT's frozen inputs require grad) with
    ``fastft.offload.gradient_checkpointing_func`` (an ``offloaded_checkpoint``) as every layer's checkpoint
    function. ``config`` or ``OffloadConfig`` fields as keywords configure it.
    """
    if config is not None and config_fields:
        raise ValueError("give either config or OffloadConfig fields as keywords, not both")
    if config is not None and not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be a fastft.OffloadConfig or None, got {type(config).__name__}")
    config = config or OffloadConfig(**config_fields)
    if not hasattr(model, "gradient_checkpointing_enable") or not hasattr(model, "_set_gradient_checkpointing"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    func = (
        gradient_checkpointing_func
        if config == OffloadConfig()
        else functools.partial(offloaded_checkpoint, offload_config=config)
    )
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    return model


def has_experts(model) -> bool:
    """Whether a transformers model holds experts blocks (``use_experts_implementation``)."""
    return any(
        hasattr(m, "down_proj") and hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules()
    )


def apply(model, *, packing: bool = True, offload_checkpointing: bool = True, moe: bool = True, lora: bool = True):
    """fastft for a transformers model (or a PEFT model around one), in place; returns the model.
    ``packing``: ``use_packed_attention``; ``offload_checkpointing``: gradient checkpointing through
    ``fastft.offloaded_checkpoint``; ``moe``: ``use_moe`` when the model has experts blocks; ``lora``:
    ``fastft.integrations.peft.use_lora`` when it has PEFT LoRA layers (so call ``apply`` after
    ``peft.get_peft_model``)."""
    from . import peft as ft_peft

    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if packing:
        use_packed_attention(model)
    if moe and has_experts(model):
        use_moe(model)
    if lora and ft_peft.has_lora(model):
        ft_peft.use_lora(model)
    if offload_checkpointing:
        enable_gradient_checkpointing(model)
    return model
