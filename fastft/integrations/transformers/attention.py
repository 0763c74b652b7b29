"""Packed-sequence attention for transformers models: the attention function ``"fastft"`` (transformers'
attention registry) and the decoder stack's forward pre-hook that builds each batch's ``PackedSeqInfo`` once
for every layer."""

from __future__ import annotations

import weakref

import torch

from ...attention import packed_attention
from ...packing import packed_seq_info
from ..models import PACKED_INFO_KWARG, decoder_stack, model_state, transformers_model
from . import graph_padding, lifecycle
from .mixer_ops import CALL_KWARGS
from .mixers import check_packing, use_packed_mixers

ATTENTION_IMPLEMENTATION = "fastft"


_PACKED = weakref.WeakSet()  # the modules of models under use_packed_attention: their attention must get the info


def batch_info(batch: int, tokens: int, device, kwargs: dict):
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

    ``query`` is ``[B, H, T, D]``, ``key`` ``[B, H_kv, T, D]``, ``value`` ``[B, H_kv, T, Dv]`` (``Dv``: MLA's own
    value head dim, usually ``D``); returns (``[B, T, H, Dv]``, None).
    The ``PackedSeqInfo`` comes from the decoder stack's pre-hook (built once per forward, see
    ``use_packed_attention``), or from the layer's own ``position_ids`` / ``cu_seq_lens_q`` when the layer is
    called without that hook.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            "fastft packed attention needs keys for exactly the query tokens (training or prefill, no KV cache)"
        )
    unsupported = unsupported_attention(module, attention_mask, kwargs)
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} asks fastft's packed attention for {unsupported}, which it does not compute: "
            "apply(model, packing=False) keeps the model's own attention"
        )
    info = kwargs.get(PACKED_INFO_KWARG)
    if info is None:
        if module in _PACKED and kwargs.get("position_ids") is None and kwargs.get("cu_seq_lens_q") is None:
            raise ValueError(
                f"{type(module).__name__} gets neither the batch's PackedSeqInfo nor position ids: its model does not "
                "hand the layers' keyword arguments to attention, so fastft cannot see where documents start; "
                "apply(model, packing=False) keeps the model's own attention"
            )
        info = batch_info(query.shape[0], query.shape[2], query.device, kwargs)
    window = int(sliding_window) if sliding_window else None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = packed_attention(
        q, k, v, info, window=window, sinks=getattr(module, "sinks", None), scale=scaling, dropout_p=dropout
    )
    return out, None


def unsupported_attention(module, attention_mask, kwargs) -> str | None:
    """What a layer's call asks of attention beyond causal, per-document softmax attention (with a window,
    dropout and gpt-oss's sinks): None, or what it is. Transformers builds no mask for ``"fastft"`` (it is not
    in the mask registry), so a mask here is the layer's own (e.g. a learned bias)."""
    if attention_mask is not None:
        return "an attention mask or bias of its own"
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        return "bidirectional attention (is_causal=False)"
    for name, what in (
        ("softcap", "logit soft-capping"),
        ("position_bias", "a position bias"),
        ("indices", "sparse attention (selected keys)"),
        ("block_indices", "sparse attention (selected key blocks)"),
    ):
        if kwargs.get(name) is not None:
            return what
    if kwargs.get("s_aux") is not None and getattr(module, "sinks", None) is None:
        return "attention sinks held outside the layer's `sinks`"
    return None


def prepare_packed_batch(module, args, kwargs, graphs: bool | str = False):
    """Forward pre-hook of the decoder stack, once per forward that fastft serves (``lifecycle``): a 2D
    ``attention_mask`` (padding) becomes position ids whose padding tokens are one-token documents (no sync),
    since transformers passes no mask to a registered attention function; with ``graphs`` (the checkpointing
    concern's record) the batch is padded to its token bucket (``graph_padding``); then the batch's
    ``PackedSeqInfo`` is built once and handed to every layer under ``PACKED_INFO_KWARG``."""
    graph_padding.drop_stale(module)
    if lifecycle.forward_kind(module) == lifecycle.STOCK:
        return args, kwargs  # the model's own attention
    held = CALL_KWARGS.get()  # the boundaries a causal LM that hands its stack none was called with (Mamba's)
    if held:
        kwargs = {**held, **kwargs}
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
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        return args, kwargs  # nothing to describe
    batch, length = tokens.shape[:2]
    source = kwargs
    if graph_padding.uses_graphs(module, graphs):
        padded = graph_padding.pad_for_graphs(module, args, kwargs)
        if padded is not None:
            args, kwargs, source = padded
            ids = args[0] if args else kwargs.get("input_ids")
            length = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
    info = batch_info(batch, length, tokens.device, source)
    return args, {**kwargs, PACKED_INFO_KWARG: info}


def use_packed_attention(model):
    """Attention through ``attention_forward`` for every layer of a transformers model (or a PEFT model
    around one); returns the model. ``revert`` gives back the model's attention implementation and removes
    the decoder stack's pre-hook.

    A 2D padding ``attention_mask`` still works: its padding tokens become documents of their own (position
    ids restart there, which shifts rotary positions of left-padded rows by a constant).

    Layers that mix tokens outside attention get fastft's packed ops where fastft supports them (Gated
    DeltaNet, LFM2's short convolutions: ``mixers.use_packed_mixers``); any other makes it raise a
    ``ValueError`` before anything changes (``mixers.check_packing``), as does a model whose attention does
    not go through transformers' attention registry. A layer that asks the attention function for what it
    does not compute (its own mask or bias, ``is_causal=False``, soft-capping, sparse keys) raises at its
    first forward."""
    inner = transformers_model(model)
    from transformers import AttentionInterface

    check_packing(inner)  # before any change: a model fastft cannot make packing-correct is left as it was
    state = model_state(inner)
    before = inner.config._attn_implementation
    configs = lifecycle.snapshot(inner, "_attn_implementation")
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, attention_forward)
    inner.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if inner.config.get_text_config()._attn_implementation != ATTENTION_IMPLEMENTATION:
        inner.set_attn_implementation(before)
        raise ValueError(
            f"{type(inner).__name__}'s attention does not go through transformers' attention registry "
            "(AttentionInterface), so fastft cannot keep its documents apart: train it without packing "
            "(apply(model, packing=False) and padded batches)"
        )
    if "attention" not in state.records:
        ref = weakref.ref(inner)  # the hook lives on a module of the model: no reference cycle through it

        def prepare(module, args, kwargs):
            graphs = model_state(ref()).records.get("checkpointing", {}).get("graphs", False)
            return prepare_packed_batch(module, args, kwargs, graphs)

        hook = decoder_stack(model).register_forward_pre_hook(prepare, with_kwargs=True)

        layers = list(inner.modules())
        _PACKED.update(layers)

        def undo():
            hook.remove()
            inner.set_attn_implementation(before)
            for layer in layers:
                _PACKED.discard(layer)

        state.add("attention", before, undo)
    lifecycle.own(inner, "_attn_implementation", configs)
    lifecycle.watch(inner)
    use_packed_mixers(inner)
    return model
