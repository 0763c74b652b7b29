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
- offload: ``fastft.offload.enable_gradient_checkpointing``.
- LoRA: PEFT LoRA linear layers through ``fastft.lora.lora_linear`` (``fastft.integrations.peft``).

transformers (5.x; tested with 5.17) is imported only by the functions here.
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from ..packing import packed_seq_info
from ..routing import moe_expert_rows, moe_permute, moe_route, moe_unpermute

EXPERTS_IMPLEMENTATION = "fastft"
ATTENTION_IMPLEMENTATION = "fastft"


def _grouped_mm_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # torch._grouped_mm: CUDA bf16 with 16-byte aligned rows
    return (
        hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == weight.dtype == torch.bfloat16
        and x.shape[-1] % 8 == 0 and weight.shape[-1] % 8 == 0 and weight.shape[-2] % 8 == 0
    )


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x`` times expert ``e``'s matrix: ``weight[e]`` (``[in, out]``) when
    ``transposed``, else ``weight[e].T`` (``weight`` is ``[E, out, in]``). ``torch._grouped_mm`` where it
    runs (CUDA bf16, aligned sizes; no host sync); otherwise one matmul per expert, which reads ``ends``
    on the host."""
    w = weight if transposed else weight.transpose(-2, -1)
    if _grouped_mm_ok(x, weight):
        return torch._grouped_mm(x, w, offs=ends)
    starts = [0] + ends.tolist()
    rows = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, starts[1:]))]
    return torch.cat(rows + [x.new_zeros(x.shape[0] - starts[-1], w.shape[-1])])  # padding rows: 0


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
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
    if not _has_experts(model):
        raise ValueError(f"{type(model).__name__} has no transformers experts blocks (use_experts_implementation) to route")
    register()
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return model


# ---- packed-sequence attention --------------------------------------------------------------------------


def _seq_info(query: torch.Tensor, kwargs: dict):
    batch, _, tokens, _ = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        max_len = kwargs.get("max_length_q")
        return packed_seq_info(cu_seqlens=cu, max_seqlen=int(max_len) if max_len is not None else None,
                               num_tokens=batch * tokens, device=query.device)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return packed_seq_info(seq_lengths=[tokens] * batch, device=query.device)
    if position_ids.shape[0] != batch:  # transformers passes [1, T] for a batch of plain rows
        position_ids = _expanded(position_ids, batch)
    return packed_seq_info(position_ids=position_ids)


_expand_memo: list = []  # [(source, version, batch, expanded)]: the last [1, T] -> [B, T] expansion


def _expanded(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``position_ids.expand(batch, -1)``, the same tensor object for every layer of a forward, so the
    ``packed_seq_info`` memo (tensor identity and version) hits after the first layer."""
    if position_ids.is_inference():
        return position_ids.expand(batch, -1)
    for source, version, b, expanded in _expand_memo:
        if source is position_ids and version == position_ids._version and b == batch:
            return expanded
    expanded = position_ids.expand(batch, -1)
    _expand_memo[:] = [(position_ids, position_ids._version, batch, expanded)]
    return expanded


@functools.cache
def _varlen():
    """(varlen_attn, its parameter names) from torch, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_attention(query, key, value, info, scaling, window):
    """Flash variable-length attention over the flattened stream, or None where torch's cannot run it."""
    found = _varlen()
    if found is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    fn, params = found
    batch, heads, tokens, dim = query.shape
    options = {"scale": scaling}
    if "window_size" in params:
        options["window_size"] = (window - 1 if window else -1, 0)  # (left, right): causal, window keys
    elif window or "is_causal" not in params:
        return None
    else:
        options["is_causal"] = True
    if key.shape[1] != heads:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // key.shape[1], 1)
            value = value.repeat_interleave(heads // value.shape[1], 1)
    q, k, v = (t.transpose(1, 2).reshape(batch * tokens, t.shape[1], dim) for t in (query, key, value))
    cu = info.cu_seqlens
    out = fn(q, k, v, cu, cu, info.max_seqlen, info.max_seqlen, **options)
    return out.view(batch, tokens, heads, dim)


@functools.cache
def _flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


class _SinkAttention(torch.autograd.Function):
    """Causal flash variable-length attention whose every softmax row also holds a per-head sink logit that
    attends to nothing (gpt-oss's attention sinks), from torch's flash kernels: with ``lse`` a row's
    log-sum-exp, the sink leaves ``keep = sigmoid(lse - sink)`` of the row's mass, so the output is
    ``keep * flash_out``. Backward is flash's backward given ``keep * grad`` and the final output (its
    ``rowsum(grad * out)`` term then carries the sink), and ``d sink = -sum((1 - keep) * rowsum(grad * out))``.
    ``q``: ``[N, H, D]``, ``k``/``v``: ``[N, H_kv, D]``, ``sinks``: ``[H]``; ``left``: keys left of the query
    in the window, -1 for none."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, scale, left):
        out, lse = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False,
            scale=scale, window_size_left=left, window_size_right=0)[:2]
        keep = torch.sigmoid(lse - sinks.float()[:, None]).T[:, :, None]  # [N, H, 1]
        y = (out * keep).to(q.dtype)
        ctx.save_for_backward(q, k, v, y, lse, keep, cu_seqlens)
        ctx.args = (max_seqlen, scale, left, sinks.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse, keep, cu = ctx.saved_tensors
        max_seqlen, scale, left, sinks_dtype = ctx.args
        no_rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is 0: no random state (as torch's varlen_attn)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            (dy * keep).to(q.dtype), q, k, v, y, lse, cu, cu, max_seqlen, max_seqlen, 0.0, True, no_rng,
            torch.empty(0, device=q.device), scale=scale, window_size_left=left, window_size_right=0)
        dsinks = None
        if ctx.needs_input_grad[3]:
            dsinks = -((1 - keep[..., 0]) * (dy.float() * y.float()).sum(-1)).sum(0).to(sinks_dtype)
        return dq, dk, dv, dsinks, None, None, None, None


def _sink_attention(query, key, value, sinks, info, scaling, window):
    """``_SinkAttention`` over the flattened stream, or None where torch's flash kernels cannot run it."""
    batch, heads, tokens, dim = query.shape
    if (not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16) or dim % 8 or dim > 256
            or heads % key.shape[1] or not _flash_capable(query.device)):
        return None
    q, k, v = (t.transpose(1, 2).reshape(batch * tokens, t.shape[1], dim) for t in (query, key, value))
    scale = scaling if scaling is not None else dim ** -0.5
    out = _SinkAttention.apply(q, k, v, sinks, info.cu_seqlens, info.max_seqlen, scale, window - 1 if window else -1)
    return out.view(batch, tokens, heads, dim)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """transformers attention function ``"fastft"``: causal attention inside each document only.

    ``query`` is ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, T, D]``; returns (``[B, T, H, D]``, None).
    Runs torch's flash variable-length attention where it can (CUDA, bf16/fp16, no dropout), else SDPA
    with the fastft mask. Modules with attention sinks (gpt-oss) run ``_SinkAttention`` on flash kernels
    where they can, else their own eager attention with the fastft mask.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError("fastft packed attention needs keys for exactly the query tokens (training or prefill, no KV cache)")
    info = _seq_info(query, kwargs)
    window = int(sliding_window) if sliding_window else None
    if getattr(module, "sinks", None) is not None:
        out = None if dropout else _sink_attention(query, key, value, module.sinks, info, scaling, window)
        if out is not None:
            return out, None
        eager = sys.modules[type(module).__module__].eager_attention_forward
        mask = info.sdpa_mask(window=window, dtype=query.dtype)
        return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    if not dropout:
        out = _varlen_attention(query, key, value, info, scaling, window)
        if out is not None:
            return out, None
    mask = info.sdpa_mask(window=window, dtype=torch.bool)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def _padding_to_documents(module, args, kwargs):
    """Forward pre-hook: a 2D ``attention_mask`` (padding) becomes position ids whose padding tokens are
    one-token documents (no sync), since transformers passes no mask to a registered attention function."""
    if len(args) > 1:
        raise ValueError("with fastft packed attention, pass attention_mask and position_ids as keyword arguments")
    mask = kwargs.get("attention_mask")
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("fastft packed attention takes a 2D padding attention_mask (or none), not a prepared mask")
    keep = mask.bool()
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = keep.long().cumsum(-1) - 1
    kwargs = {**kwargs, "attention_mask": None, "position_ids": torch.where(keep, positions, 0)}
    return args, kwargs


def use_packed_attention(model):
    """Attention through ``attention_forward`` for every layer of a transformers model; returns the model.

    A 2D padding ``attention_mask`` still works: its padding tokens become documents of their own (position
    ids restart there, which shifts rotary positions of left-padded rows by a constant)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, attention_forward)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if not getattr(model, "_fastft_padding_hook", False):
        model.register_forward_pre_hook(_padding_to_documents, with_kwargs=True)
        model._fastft_padding_hook = True
    return model


def _has_experts(model) -> bool:
    return any(hasattr(m, "down_proj") and hasattr(m, "has_gate") and hasattr(m, "is_transposed") for m in model.modules())


def apply(model, *, packing: bool = True, offload_checkpointing: bool = True, moe: bool = True, lora: bool = True):
    """fastft for a transformers model (or a PEFT model around one), in place; returns the model.
    ``packing``: ``use_packed_attention``; ``offload_checkpointing``: gradient checkpointing through
    ``fastft.offloaded_checkpoint``; ``moe``: ``use_moe`` when the model has experts blocks; ``lora``:
    ``fastft.integrations.peft.use_lora`` when it has PEFT LoRA layers (so call ``apply`` after
    ``peft.get_peft_model``)."""
    from ..offload import enable_gradient_checkpointing
    from . import peft as ft_peft

    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if packing:
        use_packed_attention(model)
    if moe and _has_experts(model):
        use_moe(model)
    if lora and ft_peft.has_lora(model):
        ft_peft.use_lora(model)
    if offload_checkpointing:
        enable_gradient_checkpointing(model)
    return model
