"""Hugging Face transformers integration: packed-sequence attention, offloaded checkpointing and MoE
experts blocks from fastft, through transformers' own registries (no model code copied or edited).

    from fastft.integrations.transformers import apply
    model = apply(model)   # packing, offloaded checkpointing, MoE experts, LoRA, the loss, norms, SwiGLU, rotary

One concern per module, each recording its own undo in the model's ``ModelState``
(``fastft.integrations.models``), which ``revert`` runs last first:

- ``attention``: ``use_packed_attention(model)``, attention function ``"fastft"`` (transformers' attention
  registry): document boundaries from ``position_ids`` (e.g. ``DataCollatorWithFlattening``) or the
  collator's ``cu_seq_lens_q`` + ``max_length_q``, built once per forward as a ``PackedSeqInfo`` and reused
  by every layer; no document attends to another; each layer's sliding window is honoured.
- ``experts``: ``use_moe(model)``, experts implementation ``"fastft"`` (transformers' experts registry), see
  ``experts_forward``; ``expert_parallel``: ``use_expert_parallel``, ``expert_parameters``.
- ``mixers``: token mixers besides attention in packed batches: fastft's packed ops in Gated DeltaNet and
  LFM2's short convolutions, a ``ValueError`` for any other (``check_packing``, ``packing_blockers``).
- ``checkpointing``: ``enable_gradient_checkpointing`` (``fastft.offloaded_checkpoint`` as the checkpoint
  function, kept when ``Trainer``/TRL/PEFT call ``gradient_checkpointing_enable`` again).
- ``memory``: ``use_memory_plan(model, memory_budget)``: per checkpointed layer keep, selective, recompute
  or offload, planned from the first step's measurements to fit the budget in the least time
  (``fastft.memory_plan``); ``memory_plan(model)`` the plan in force.
- ``loss``: ``use_linear_cross_entropy(model)``: a training forward's causal-LM loss through
  ``fastft.linear_cross_entropy`` (no logits of all tokens at once); the model's own loss, with a warning
  naming why, where that would not be exact.
- ``norms``: ``use_rms_norm(model)``: RMSNorm layers of the forms ``fastft.rms_norm`` computes run it in
  training forwards.
- ``mlps``: ``use_swiglu(model)``: gated MLPs with SiLU run ``fastft.swiglu`` between their projections in
  training forwards.
- ``rotary``: ``use_rotary(model)``: attention layers' ``apply_rotary_pos_emb`` of the forms ``fastft.rotary``
  computes runs it in their training forwards.
- LoRA: PEFT LoRA linear layers through ``fastft.lora.lora_linear`` (``fastft.integrations.peft``).

transformers (5.x; tested with 5.17) is imported only by the functions here.
"""

from __future__ import annotations

import functools
import warnings

from ..._checks import bool_arg, int_arg
from ...memory_plan import check_memory_budget
from ...memory_planner import MemoryPlanner
from .. import liger
from .. import peft as ft_peft
from ..models import STATE, decoder_layers, has_experts, hf_model, model_state, pop_model_state, transformers_model
from ..models import ModelState as ModelState
from ..models import decoder_stack as decoder_stack
from ..models import is_experts_block as is_experts_block
from . import lifecycle, versions
from .attention import ATTENTION_IMPLEMENTATION as ATTENTION_IMPLEMENTATION
from .attention import PACKED_INFO_KWARG as PACKED_INFO_KWARG
from .attention import attention_forward as attention_forward
from .attention import use_packed_attention
from .checkpointing import enable_gradient_checkpointing, graphs_arg
from .expert_parallel import expert_parameters, use_expert_parallel
from .experts import EXPERT_SHARD as EXPERT_SHARD
from .experts import EXPERTS_IMPLEMENTATION as EXPERTS_IMPLEMENTATION
from .experts import ExpertShard as ExpertShard
from .experts import experts_forward as experts_forward
from .experts import register as register
from .experts import use_moe
from .loss import use_linear_cross_entropy
from .memory import memory_plan, memory_planner, use_memory_plan
from .mixers import check_packing, packing_blockers
from .mlps import use_swiglu
from .norms import use_rms_norm
from .rotary import use_rotary

# The user verbs; the names re-exported "as" themselves above stay importable from here, as in 0.2.
__all__ = [
    "apply",
    "revert",
    "use_packed_attention",
    "use_moe",
    "enable_gradient_checkpointing",
    "use_memory_plan",
    "use_linear_cross_entropy",
    "use_rms_norm",
    "use_swiglu",
    "use_rotary",
    "memory_plan",
    "memory_planner",
    "use_expert_parallel",
    "expert_parameters",
    "hf_model",
    "has_experts",
    "decoder_layers",
    "check_packing",
    "packing_blockers",
]

# What a RuntimeWarning of apply names, for each concern that leaves layers on their own code.
_LEFT = {
    "norms": "RMSNorm layers on their own forward (a form fastft.rms_norm",
    "swiglu": "gated MLPs on their own forward (a form or activation fastft.swiglu",
    "rotary": "attention layers on their own apply_rotary_pos_emb (a form fastft.rotary",
}


def apply(
    model,
    *,
    packing: bool = True,
    offload_checkpointing: bool = True,
    moe: bool = True,
    lora: bool = True,
    loss: bool = True,
    norms: bool = True,
    swiglu: bool = True,
    rotary: bool = True,
    graphs: bool | str = False,
    memory_budget=None,
    max_tokens: int | None = None,
):
    """fastft for a transformers model (or a PEFT model around one), in place; returns the model.
    ``packing``: ``use_packed_attention``; ``offload_checkpointing``: gradient checkpointing through
    ``fastft.offloaded_checkpoint`` (kept through later ``gradient_checkpointing_enable`` calls, e.g. by
    ``Trainer``); ``moe``: ``use_moe`` when the model has experts blocks (Liger-Kernel's included);
    ``lora``: ``fastft.integrations.peft.use_lora`` when it has PEFT LoRA layers (so call ``apply`` after
    ``peft.get_peft_model``); ``loss``: ``use_linear_cross_entropy``: a training forward with labels computes
    its causal-LM loss without every token's logits, and returns ``logits=None`` (a model whose loss that
    would change keeps its own, with a warning); ``norms``: ``use_rms_norm``: RMSNorm layers through
    ``fastft.rms_norm`` in training forwards (norms of other forms keep theirs, with a warning); ``swiglu``:
    ``use_swiglu``: gated MLPs' ``silu(gate) * up`` through ``fastft.swiglu`` in training forwards (other forms
    and activations keep theirs, with a warning); ``rotary``: ``use_rotary``: the attention layers'
    ``apply_rotary_pos_emb`` through ``fastft.rotary`` in training forwards (other forms keep theirs, with a
    warning); ``graphs``:
    each checkpointed layer replayed as CUDA graphs (``fastft.graphs.graphed_checkpoint``; needs
    ``offload_checkpointing``), ``"auto"``: only the layers whose eager forward is launch-bound (its
    ``policy="auto"``); ``memory_budget``: None (every checkpointed
    layer recomputes, its input offloaded), or the memory a step may use: bytes (an int), a fraction of the
    GPU in (0, 1], or ``"auto"`` (what the GPU has free less a margin): each checkpointed layer then keeps,
    selectively checkpoints, recomputes or offloads, planned from the first step's measurements for steps of
    up to ``max_tokens`` tokens (``use_memory_plan``, docs/memory.md; needs ``offload_checkpointing``).
    ``revert(model)`` undoes it. ``TypeError`` for anything but a transformers model, an option that is not a
    bool, or ``graphs`` not True, False or ``"auto"``; ``TypeError``/``ValueError`` for a bad
    ``memory_budget`` or ``max_tokens``."""
    transformers_model(model)
    versions.check_version()
    switches = dict(
        packing=packing,
        offload_checkpointing=offload_checkpointing,
        moe=moe,
        lora=lora,
        loss=loss,
        norms=norms,
        swiglu=swiglu,
        rotary=rotary,
    )
    for name, value in switches.items():
        bool_arg(name, value)
    graphs_arg(graphs)
    if memory_budget is not None:
        if not isinstance(memory_budget, MemoryPlanner):
            check_memory_budget(memory_budget)
        elif max_tokens is not None:
            raise ValueError("give max_tokens to the MemoryPlanner, not beside it")
        if not offload_checkpointing:
            raise ValueError("memory_budget needs offload_checkpointing=True: the plan is fastft's checkpointing")
    if max_tokens is not None:
        if memory_budget is None:
            raise ValueError("max_tokens sizes the memory plan: give memory_budget too")
        int_arg("max_tokens", max_tokens, minimum=1)
    if graphs and not offload_checkpointing:
        raise ValueError(
            f"graphs={graphs!r} needs offload_checkpointing=True: the graphs are replayed by fastft's checkpoint"
        )
    inner = hf_model(model)
    fresh = STATE not in inner.__dict__
    state = model_state(inner)
    done, records = len(state.undo), set(state.records)
    try:
        if packing:
            use_packed_attention(model)
        if moe and has_experts(model):
            use_moe(model)
        if moe:
            liger.route_liger_experts(model)
        if lora and ft_peft.has_lora(model):
            ft_peft.use_lora(model)
            if "lora" not in state.records:
                state.add("lora", None, functools.partial(ft_peft.revert_lora, inner))
        if loss:
            use_linear_cross_entropy(model)
        layers = (("norms", norms, use_rms_norm), ("swiglu", swiglu, use_swiglu), ("rotary", rotary, use_rotary))
        for key, on, use in layers:
            if on and key not in state.records:
                _, left = use(model)
                if left:
                    warnings.warn(
                        f"fastft keeps these {_LEFT[key]} does not compute, or another library's): {', '.join(left)}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        if offload_checkpointing:
            enable_gradient_checkpointing(model, graphs=graphs)
        if memory_budget is not None:
            use_memory_plan(model, memory_budget, max_tokens=max_tokens)
        lifecycle.watch(model)  # fastft serves training and packed forwards; the model's own code the others
    except BaseException:
        # a refusal part way leaves the model as it was: what this call changed is undone, last first
        undos, state.undo[done:] = state.undo[done:], []
        for undo in reversed(undos):
            undo()
        for key in set(state.records) - records:
            del state.records[key]
        if fresh:
            pop_model_state(inner)
        raise
    return model


def revert(model):
    """Undo ``apply`` (and ``use_packed_attention``, ``use_moe``, ``enable_gradient_checkpointing``,
    ``use_expert_parallel``): every change fastft recorded on the model, last first: the full experts on
    every rank after ``use_expert_parallel`` (a collective: call it on every rank), each checkpointed layer's
    checkpoint flag and function as they were (torch's, or none), PEFT LoRA layers back on PEFT's forward,
    Liger's experts blocks on Liger's, the experts and attention implementations the model had and its
    forward pre-hooks removed; returns the model. ``TypeError`` for anything but a transformers model (or a
    PEFT model around one); ``ValueError`` if fastft set nothing on it."""
    inner = transformers_model(model)
    state = pop_model_state(inner)
    if state is None:
        raise ValueError(f"{type(model).__name__} has nothing from fastft to revert (apply was not called on it)")
    for undo in reversed(state.undo):
        undo()
    return model
