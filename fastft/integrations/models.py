"""What fastft's integrations know about a transformers model: the model inside a PEFT wrapper, its decoder
stack and layers, its experts blocks, and the record of what fastft changed on it (each change's undo, run
by ``revert``). Imported by ``fastft.integrations.transformers`` and ``fastft.integrations.liger``; it
imports neither (nor transformers, outside ``decoder_layers``)."""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Callable

import torch

STATE = "_fastft_state"  # in the transformers model's __dict__: its ModelState
PACKED_INFO_KWARG = "fastft_packed_info"  # the forward keyword that hands each layer the batch's PackedSeqInfo

_aside = threading.local()  # per thread: how many forwards that run the model's own code are under way


@dataclasses.dataclass(eq=False)
class ModelState:
    """What fastft changed on one transformers model."""

    undo: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # in the order done; revert: last first
    records: dict = dataclasses.field(default_factory=dict)  # each concern's own record, under its own key

    def add(self, key: str, value, undo: Callable[[], None]) -> None:
        """A concern's first change: its record (what later calls of it read) and how to undo the change."""
        if key in self.records:
            raise RuntimeError(f"fastft's {key} is already recorded on this model")
        self.records[key] = value
        self.undo.append(undo)


def stepping_aside() -> bool:
    """Whether a forward that runs the model's own code is under way (``fastft.integrations.transformers.
    lifecycle``: generation with a cache, evaluation of plain or padded rows): fastft's module forwards
    (PEFT LoRA layers, Liger's experts) then run the forward they replaced. Per thread: a model generating
    in one thread leaves another's training in its own on fastft's paths."""
    return getattr(_aside, "count", 0) > 0


def step_aside(delta: int) -> None:
    """Count a forward that runs the model's own code in (+1) or out (-1), in this thread."""
    _aside.count = max(getattr(_aside, "count", 0) + delta, 0)


def patch_forward(module, fn) -> None:
    """``fn`` bound to ``module`` as its forward (an instance attribute, over its class's)."""
    module.__dict__["forward"] = types.MethodType(fn, module)


def unpatch_forwards(modules, fn) -> None:
    """Remove ``patch_forward``'s ``fn`` from each of ``modules`` where it is still there (a library that patched
    an instance since keeps its own)."""
    for module in modules:
        if getattr(module.__dict__.get("forward"), "__func__", None) is fn:
            del module.__dict__["forward"]


def hf_model(model):
    """The transformers model itself: ``model``, or the one inside a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def transformers_model(model) -> torch.nn.Module:
    """``hf_model(model)``; ``TypeError`` unless it is a transformers ``PreTrainedModel``."""
    inner = hf_model(model)
    if not isinstance(inner, torch.nn.Module) or not hasattr(inner, "set_attn_implementation"):
        raise TypeError(
            f"model must be a transformers PreTrainedModel (or a PEFT model around one), got {type(model).__name__}"
        )
    return inner


def model_state(inner) -> ModelState:
    """The ``ModelState`` of a transformers model (created empty the first time)."""
    state = inner.__dict__.get(STATE)
    if state is None:
        state = inner.__dict__[STATE] = ModelState()
    return state


def pop_model_state(inner) -> ModelState | None:
    """Take the ``ModelState`` off a transformers model (None if fastft changed nothing on it)."""
    return inner.__dict__.pop(STATE, None)


def decoder_stack(model):
    """The transformers module whose forward takes ``input_ids``/``position_ids`` and calls the layers."""
    inner = hf_model(model)
    return getattr(inner, "base_model", inner)


def decoder_layers(model) -> list:
    """The repeated decoder layers of a transformers model (PEFT-wrapped or not): its checkpointable layers."""
    from transformers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def is_experts_block(module) -> bool:
    """Whether ``module`` is a transformers experts block (``use_experts_implementation``)."""
    return hasattr(module, "down_proj") and hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def experts_blocks(model) -> list:
    """The transformers experts blocks of ``model`` (not Liger-Kernel's ``LigerExperts``)."""
    return [m for m in model.modules() if is_experts_block(m)]


def has_experts(model) -> bool:
    """Whether a transformers model holds experts blocks (``use_experts_implementation``): whether the
    integration treats it as a MoE model."""
    return bool(experts_blocks(model))
