"""Liger-Kernel beside fastft: its MoE experts blocks stay on fastft's experts path.

Liger's ``swiglu=True`` puts its fused MoE in place of a MoE model's experts blocks: a model built after
``apply_liger_kernel_to_*()`` has ``LigerExperts`` modules; a model patched in place
(``apply_liger_kernel_to_*(model=...)``, ``Trainer(use_liger_kernel=True)``) keeps transformers' blocks
with Liger's forward bound on each instance, which bypasses transformers' experts dispatch. Either way
fastft's routing would silently stop being used. ``fastft.integrations.transformers.apply`` keeps it, and
warns once when it does:

- ``LigerExperts`` blocks run ``routed_experts`` (same weights, SiLU gate);
- Liger's instance forwards are taken off transformers' blocks, at ``apply`` and, for a patch made later
  (``Trainer`` applies Liger inside ``train()``), at the next forward;
- ``revert`` puts Liger's back (each step records its undo in the model's ``ModelState``).

Liger's other kernels (RMSNorm, rotary, SwiGLU MLP, fused linear cross entropy) compose with fastft as
they are. liger_kernel is never imported here: its modules are recognised by their module name.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch
import torch.nn.functional as F

from ..experts import routed_experts
from .models import decoder_stack, experts_blocks, hf_model, model_state, stepping_aside

__all__ = ["is_liger_experts", "liger_experts_forward", "route_liger_experts", "keep_fastft_experts"]


def _from_liger(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("liger_kernel")


def _liger_forward(module) -> bool:
    forward = module.__dict__.get("forward")
    return forward is not None and _from_liger(getattr(forward, "__func__", forward))


def is_liger_experts(module) -> bool:
    """Whether ``module`` is Liger-Kernel's ``LigerExperts`` (its fused MoE experts block)."""
    return type(module).__name__ == "LigerExperts" and _from_liger(type(module))


def _silu_gate(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def liger_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """``LigerExperts.forward`` through fastft's ``routed_experts`` (``gate_up_proj`` ``[E, 2I, H]``, gate
    half first, SiLU; ``down_proj`` ``[E, H, I]``); Liger's own forward where fastft steps aside."""
    if stepping_aside():
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    shape = hidden_states.shape
    out = routed_experts(
        hidden_states.reshape(-1, shape[-1]),
        top_k_index.reshape(-1, top_k_index.shape[-1]),
        top_k_weights.reshape(-1, top_k_weights.shape[-1]),
        self.gate_up_proj,
        self.down_proj,
        transposed=False,
        activation=_silu_gate,
    )
    return out.view(shape)


def route_liger_experts(model) -> int:
    """Run every ``LigerExperts`` block of ``model`` through fastft (warns once); returns how many. ``revert``
    gives them back to Liger."""
    blocks = [m for m in model.modules() if is_liger_experts(m) and "forward" not in m.__dict__]
    for block in blocks:
        block.forward = types.MethodType(liger_experts_forward, block)
    if blocks:
        model_state(hf_model(model)).undo.append(functools.partial(_give_back, blocks))
        warnings.warn(
            f"fastft runs the {len(blocks)} LigerExperts blocks (Liger-Kernel's swiglu=True) through its own "
            "experts path; revert(model) gives them back to Liger",
            stacklevel=3,
        )
    return len(blocks)


def _give_back(blocks) -> None:
    for block in blocks:
        block.__dict__.pop("forward", None)


class _Kept:
    """``keep_fastft_experts``' record: the experts blocks it watches and the Liger attributes taken off."""

    def __init__(self) -> None:
        self.blocks = []
        self.taken = {}  # block -> its instance attributes from Liger (forward, _get_name)

    def unpatch(self, when: str) -> None:
        patched = [b for b in self.blocks if _liger_forward(b)]
        for block in patched:
            self.taken[block] = {k: block.__dict__.pop(k) for k in ("forward", "_get_name") if k in block.__dict__}
        if patched:
            warnings.warn(
                f"Liger-Kernel's swiglu patch replaced the forward of {len(patched)} experts blocks {when}; fastft "
                "keeps its own experts path there (pass swiglu=False to Liger to silence this)",
                stacklevel=3,
            )

    def check(self, module, args) -> None:  # forward pre-hook of the decoder stack
        if any("forward" in b.__dict__ for b in self.blocks):
            self.unpatch("after fastft's apply")

    def give_back(self) -> None:
        for block, attributes in self.taken.items():
            block.__dict__.update(attributes)


def keep_fastft_experts(model) -> None:
    """Take Liger's instance forwards off ``model``'s transformers experts blocks, now and (through a forward
    pre-hook on the decoder stack) whenever they come back; ``revert`` puts them back."""
    state = model_state(hf_model(model))
    kept = state.records.get("liger_forwards")
    if kept is None:
        kept = _Kept()
        hook = decoder_stack(model).register_forward_pre_hook(kept.check)

        def undo():
            hook.remove()
            kept.give_back()

        state.add("liger_forwards", kept, undo)
    kept.blocks = experts_blocks(model)
    kept.unpatch("before fastft's apply")
