"""Memory plan for a transformers model: each checkpointed decoder layer keeps, selectively checkpoints,
recomputes or offloads, as ``fastft.memory_planner.MemoryPlanner`` chooses from the first training step's
measurements to fit a memory budget in the least time (``apply(model, memory_budget=...)``).

- Which layers: those transformers checkpoints (``gradient_checkpointing_enable``'s ``every_n_layers``, e.g.
  from ``Trainer``/TRL); a layer it leaves uncheckpointed keeps its activations and counts in the measured
  peak. ``gradient_checkpointing=True`` means the plan may checkpoint the layers; it need not.
- Each planned layer's checkpoint function is the planner's around fastft's (``offloaded_checkpoint``, or
  ``graphed_checkpoint`` with ``graphs``), put on again whenever checkpointing is turned on again (which
  starts a new measurement: the checkpointed layers may have changed).
- With ``graphs``, a layer keeps (eager, no graph), recomputes or offloads (both replayed as graphs):
  selective checkpointing caches ops inside the layer, which a graph replay cannot. With a ``context_fn``
  among the checkpointing options the user's wins: no selective either.
- Steps: a training forward of the decoder stack (``lifecycle.TRAIN``) starts one; other forwards
  (generation, evaluation) checkpoint nothing and are not planned.
"""

from __future__ import annotations

import functools
import weakref

import torch

from ...memory_plan import CHOICES, SELECTIVE, MemoryPlan
from ...memory_planner import MemoryPlanner
from ..models import decoder_layers, decoder_stack, model_state, transformers_model
from . import lifecycle

__all__ = ["use_memory_plan", "memory_plan", "memory_planner"]


def use_memory_plan(model, memory_budget="auto", *, max_tokens: int | None = None) -> MemoryPlanner:
    """Plan the checkpointing of a model under fastft's checkpointing (``apply``, or
    ``enable_gradient_checkpointing``) for ``memory_budget`` (bytes, a fraction of the device in (0, 1],
    ``"auto"``, or a ``MemoryPlanner``) and steps of up to ``max_tokens`` tokens; returns the planner.
    ``ValueError`` without fastft's checkpointing, or for a budget in bytes not above what the model already
    holds on its GPU. Calling it again replaces the planner."""
    inner = transformers_model(model)
    planner = memory_budget
    if not isinstance(planner, MemoryPlanner):
        planner = MemoryPlanner(memory_budget, max_tokens=max_tokens)
    elif max_tokens is not None:
        raise ValueError("give max_tokens to the MemoryPlanner, not beside it")
    state = model_state(inner)
    if "checkpointing" not in state.records:
        raise ValueError(
            "memory_budget plans fastft's checkpointing: apply the model with offload_checkpointing=True "
            "(or call enable_gradient_checkpointing first)"
        )
    device = next((p.device for p in inner.parameters()), None)
    if device is not None and (device.type == "cuda" or planner.device_memory is not None):
        planner.check_held(planner.memory(device).allocated())
    if "memory" not in state.records:
        hook = _watch(inner)
        state.add("memory", {}, hook.remove)
    state.records["memory"]["planner"] = planner
    install(inner)
    return planner


def memory_planner(model) -> MemoryPlanner | None:
    """The model's ``MemoryPlanner`` (None without ``use_memory_plan``)."""
    record = model_state(transformers_model(model)).records.get("memory")
    return None if record is None else record["planner"]


def memory_plan(model) -> MemoryPlan | None:
    """The plan in force on the model (None before its second training step, or without a memory plan);
    ``print`` it for a table."""
    planner = memory_planner(model)
    return None if planner is None else planner.plan


def install(inner) -> None:
    """Each checkpointed decoder layer's checkpoint function from the model's planner (nothing without one):
    called by ``enable_gradient_checkpointing`` after transformers set the checkpoint function."""
    state = model_state(inner)
    record = state.records.get("memory")
    if record is None:
        return
    planner: MemoryPlanner = record["planner"]
    checkpointing = state.records["checkpointing"]
    func, graphs = checkpointing["func"], checkpointing["graphs"]
    options = checkpointing.get("options", {})
    if options:
        func = functools.partial(func, **options)
    choices = CHOICES
    if graphs or "context_fn" in options:
        choices = tuple(c for c in CHOICES if c != SELECTIVE)
    planner.reset(forget_layers=True)
    for index, layer in enumerate(decoder_layers(inner)):
        if layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = planner.layer_function(
                index,
                func,
                offload_config=checkpointing["config"],
                choices=choices,
                module=layer,
                kind=_kind(layer),
            )


def _kind(layer) -> tuple:
    """Layers of one kind: one class, the same submodule classes under the same names."""
    return type(layer).__qualname__, tuple((n, type(m).__qualname__) for n, m in layer.named_modules())


def _watch(inner):
    """The decoder stack's pre-hook that starts each training step of the model's planner."""
    stack = decoder_stack(inner)
    ref = weakref.ref(inner)

    def begin(module, args, kwargs):
        inner = ref()
        if inner is None or lifecycle.forward_kind(module) != lifecycle.TRAIN or not torch.is_grad_enabled():
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor):
            tokens, device = ids.numel(), ids.device
        elif isinstance(embeds, torch.Tensor):
            tokens, device = embeds.shape[:-1].numel(), embeds.device
        else:
            return
        model_state(inner).records["memory"]["planner"].begin_step(max(tokens, 1), device)

    return stack.register_forward_pre_hook(begin, with_kwargs=True)
