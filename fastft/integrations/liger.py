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
- ``revert`` puts Liger's back.

Liger's other kernels (RMSNorm, rotary, SwiGLU MLP, fused linear cross entropy) compose with fastft as
they are. liger_kernel is never imported here: its modules are recognised by their module name.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch
import torch.nn.functional as F

from .transformers import decoder_stack, is_experts_block, routed_experts


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
    half first, SiLU; ``down_proj`` ``[E, H, I]``)."""
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


def route_liger_experts(model, state: dict) -> int:
    """Run every ``LigerExperts`` block of ``model`` through fastft (warns once); returns how many."""
    blocks = [m for m in model.modules() if is_liger_experts(m) and "forward" not in m.__dict__]
    for block in blocks:
        block.forward = types.MethodType(liger_experts_forward, block)
    state.setdefault("liger_experts", []).extend(blocks)
    if blocks:
        warnings.warn(
            f"fastft runs the {len(blocks)} LigerExperts blocks (Liger-Kernel's swiglu=True) through its own "
            "experts path; revert(model) gives them back to Liger",
            stacklevel=3,
        )
    return len(blocks)


def _unpatch(state: dict, when: str) -> None:
    taken = state.setdefault("liger_forwards", {})
    patched = [b for b in state["experts_blocks"] if _liger_forward(b)]
    for block in patched:
        taken[block] = {k: block.__dict__.pop(k) for k in ("forward", "_get_name") if k in block.__dict__}
    if patched:
        warnings.warn(
            f"Liger-Kernel's swiglu patch replaced the forward of {len(patched)} experts blocks {when}; fastft "
            "keeps its own experts path there (pass swiglu=False to Liger to silence this)",
            stacklevel=3,
        )


def _check_experts(state: dict, module, args) -> None:
    if any("forward" in b.__dict__ for b in state["experts_blocks"]):
        _unpatch(state, "after fastft's apply")


def keep_fastft_experts(model, state: dict) -> None:
    """Take Liger's instance forwards off ``model``'s transformers experts blocks, now and (through a forward
    pre-hook on the decoder stack) whenever they come back."""
    state["experts_blocks"] = [m for m in model.modules() if is_experts_block(m)]
    _unpatch(state, "before fastft's apply")
    if "experts_hook" not in state:
        state["experts_hook"] = decoder_stack(model).register_forward_pre_hook(functools.partial(_check_experts, state))


def revert(state: dict) -> None:
    """Undo the above from ``apply``'s recorded ``state``: Liger's forwards and blocks back to Liger."""
    if "experts_hook" in state:
        state["experts_hook"].remove()
    for block, attributes in state.get("liger_forwards", {}).items():
        block.__dict__.update(attributes)
    for block in state.get("liger_experts", []):
        block.__dict__.pop("forward", None)
