"""Token-count buckets for CUDA-graphed layers: under ``apply(model, graphs=True | "auto")`` the decoder stack's
pre-hook pads each training batch to ``fastft.buckets.token_bucket`` tokens per row, the padding tokens
forming documents of their own, and a forward hook cuts the stack's outputs back to the real tokens, so
that logits and labels keep the caller's shapes. A padding-free stream then needs few graph signatures.

No real token attends to a padding one or shares a token-wise op with it, and the padding's outputs are
dropped: losses and gradients are the unpadded batch's. Eager runs (no graphed layer, no grad, eval mode,
generation with a cache) are not touched.
"""

from __future__ import annotations

import functools

import torch

from ...graphs import graphed_checkpoint, layer_graphs
from ...graphs.buckets import token_padding
from ...packing import packed_seq_info

PADDING = "fastft_token_padding"  # in the decoder stack's __dict__ during a padded forward: (padding, hook)
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # per-batch values


def _graphed(func) -> bool:
    while isinstance(func, functools.partial):
        if func.func is graphed_checkpoint:
            return True
        func = func.func
    return func is graphed_checkpoint


def uses_graphs(stack: torch.nn.Module) -> bool:
    """Whether a forward of the decoder stack now may replay graphed layers (training, grad enabled, a
    layer checkpointed through ``graphed_checkpoint`` that it has not sent to the eager path for good, as
    ``graphs="auto"`` does with a GPU-bound layer: then the padding would only cost)."""
    if not (stack.training and torch.is_grad_enabled()):
        return False
    if not any(
        getattr(m, "gradient_checkpointing", False) is True and _graphed(m.__dict__.get("_gradient_checkpointing_func"))
        for m in stack.modules()
    ):
        return False
    layers = [state for state in map(layer_graphs, stack.modules()) if state is not None]
    return not layers or any(state.may_replay() for state in layers)  # no layer called yet, or one replays


def pad_for_graphs(module, args, kwargs, info_kwarg: str):
    """The end of the decoder stack's pre-hook: ``(args, kwargs)`` with the batch padded to its token bucket
    and ``kwargs[info_kwarg]`` the padded batch's ``PackedSeqInfo`` when the stack uses graphs; unchanged
    otherwise. The per-batch flash keywords (``cu_seq_lens_q``, ...), which the info replaces, are dropped:
    as layer arguments they would make every batch a new graph signature."""
    stale = module.__dict__.pop(PADDING, None)
    if stale is not None:  # a forward that raised before the hook below ran
        stale[1].remove()
    info = kwargs.get(info_kwarg)
    if info is None or not uses_graphs(module):
        return args, kwargs
    ids = args[0] if args else kwargs.get("input_ids")
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    batch, length = tokens.shape[:2]
    if batch > 1 and tuple(info.shape) != (batch, length):
        return args, kwargs  # documents given over the flattened rows: they may cross rows
    kwargs = {k: v for k, v in kwargs.items() if k not in FLASH_KWARGS}
    pad = token_padding(length)
    if not pad.extra:
        return args, kwargs
    positions = pad.pad_positions(info.position_ids.reshape(batch, length))
    kwargs[info_kwarg] = packed_seq_info(position_ids=positions)
    if args:
        args = (pad.pad(args[0]),)
    elif ids is not None:
        kwargs["input_ids"] = pad.pad(ids)
    if kwargs.get("inputs_embeds") is not None:
        kwargs["inputs_embeds"] = pad.pad(kwargs["inputs_embeds"])
    if kwargs.get("position_ids") is not None:  # the rotary positions the caller gave
        given = kwargs["position_ids"]
        kwargs["position_ids"] = pad.pad_positions(given.expand(batch, -1) if given.dim() == 2 else given[None])
    if kwargs.get("cache_position") is not None:
        cache = kwargs["cache_position"]
        kwargs["cache_position"] = torch.cat([cache, cache[-1:] + torch.arange(1, pad.extra + 1, device=cache.device)])
    handle = module.register_forward_hook(unpad_outputs, with_kwargs=True)
    module.__dict__[PADDING] = (pad, handle)
    return args, kwargs


def unpad_outputs(module, args, kwargs, output):
    """Forward hook of the decoder stack for one padded forward: its outputs cut back to the real tokens
    (``last_hidden_state``, ``hidden_states``, ``router_logits``, or a tuple's first element)."""
    pad, handle = module.__dict__.pop(PADDING)
    handle.remove()
    if isinstance(output, tuple):
        return (pad.unpad(output[0]), *output[1:])
    output.last_hidden_state = pad.unpad(output.last_hidden_state)
    if getattr(output, "hidden_states", None) is not None:
        output.hidden_states = tuple(pad.unpad(h) for h in output.hidden_states)
    if getattr(output, "router_logits", None) is not None:  # [B * T, E] per layer
        rows = output.last_hidden_state.shape[0]
        output.router_logits = tuple(
            pad.unpad(r.view(rows, pad.padded, -1)).reshape(-1, r.shape[-1]) for r in output.router_logits
        )
    return output
