"""Token-count buckets for CUDA-graphed layers: under ``apply(model, graphs=True | "auto")`` the decoder stack's
pre-hook pads each training batch to ``fastft.graphs.buckets.token_bucket`` tokens per row, the padding tokens
forming documents of their own, and a forward hook cuts the stack's outputs back to the real tokens, so
that logits and labels keep the caller's shapes. A padding-free stream then needs few graph signatures.

No real token attends to a padding one or shares a token-wise op with it, and the padding's outputs are
dropped: losses and gradients are the unpadded batch's. Eager runs (no graphed layer, no grad, eval mode,
generation with a cache) are not touched.
"""

from __future__ import annotations

import torch

from ...graphs import layer_graphs
from ...graphs.buckets import PAD_DOCUMENT, token_padding

PADDING = "fastft_token_padding"  # in the decoder stack's __dict__ during a padded forward: (padding, hook)
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # per-batch values


def drop_stale(module) -> None:
    """Remove the unpadding hook of a padded forward that raised before it ran."""
    stale = module.__dict__.pop(PADDING, None)
    if stale is not None:
        stale[1].remove()


def uses_graphs(stack: torch.nn.Module, graphs: bool | str) -> bool:
    """Whether a forward of the decoder stack now may replay graphed layers: ``graphs`` (the checkpointing
    concern's record: ``apply(model, graphs=...)``), training with grad enabled, a checkpointed layer, and
    no layer that ``graphed_checkpoint`` saw yet, or one it has not sent to the eager path for good (as
    ``graphs="auto"`` does with a GPU-bound layer: then the padding would only cost)."""
    if not (graphs and stack.training and torch.is_grad_enabled()):
        return False
    if not any(getattr(m, "gradient_checkpointing", False) is True for m in stack.modules()):
        return False
    layers = [state for state in map(layer_graphs, stack.modules()) if state is not None]
    return not layers or any(state.may_replay() for state in layers)  # no layer called yet, or one replays


def pad_for_graphs(module, args, kwargs):
    """``(args, kwargs, source)``: the batch padded to its token bucket, and the keyword arguments from which
    ``batch_info`` builds the padded batch's ``PackedSeqInfo`` (``position_ids``, or a single row's
    ``cu_seq_lens_q``); None where the documents are given over the flattened rows of several (they may cross
    rows). The per-batch flash keywords (``cu_seq_lens_q``, ...), which the info replaces, are dropped from
    ``kwargs``: as layer arguments they would make every batch a new graph signature."""
    ids = args[0] if args else kwargs.get("input_ids")
    tokens = ids if ids is not None else kwargs.get("inputs_embeds")
    batch, length = tokens.shape[:2]
    given, cu = kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q")
    if given is None and cu is not None and batch > 1:
        return None
    pad = token_padding(length)
    if given is not None:
        given = given[None] if given.dim() == 1 else given
        source = {"position_ids": pad.pad_positions(given.expand(batch, -1))}
    elif cu is not None:
        longest = kwargs.get("max_length_q")
        if longest is not None:
            longest = max(int(longest), min(pad.extra, PAD_DOCUMENT))
        source = {"cu_seq_lens_q": pad.pad_cu_seqlens(cu), "max_length_q": longest}
    else:
        rows = torch.arange(length, device=tokens.device).expand(batch, -1)
        source = {"position_ids": pad.pad_positions(rows)}
    kwargs = {k: v for k, v in kwargs.items() if k not in FLASH_KWARGS}
    if not pad.extra:
        return args, kwargs, source
    if args:
        args = (pad.pad(args[0]),)
    elif ids is not None:
        kwargs["input_ids"] = pad.pad(ids)
    if kwargs.get("inputs_embeds") is not None:
        kwargs["inputs_embeds"] = pad.pad(kwargs["inputs_embeds"])
    if kwargs.get("position_ids") is not None:  # the rotary positions the caller gave
        kwargs["position_ids"] = source["position_ids"]
    if kwargs.get("cache_position") is not None:
        cache = kwargs["cache_position"]
        kwargs["cache_position"] = torch.cat([cache, cache[-1:] + torch.arange(1, pad.extra + 1, device=cache.device)])
    handle = module.register_forward_hook(unpad_outputs, with_kwargs=True)
    module.__dict__[PADDING] = (pad, handle)
    return args, kwargs, source


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
