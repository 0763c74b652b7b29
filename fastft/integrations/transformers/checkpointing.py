"""Offloaded gradient checkpointing for transformers models: every checkpointed layer's checkpoint function
becomes fastft's (``offloaded_checkpoint``, or ``graphed_checkpoint``), and stays so when ``Trainer``, TRL
or PEFT call the model's ``gradient_checkpointing_enable`` again."""

from __future__ import annotations

import functools
import types
import warnings

from ...graphs import graphed_checkpoint
from ...offload import OffloadConfig, check_offload_config, gradient_checkpointing_func, offloaded_checkpoint
from ..models import model_state, transformers_model
from . import lifecycle, memory, versions


def graphs_arg(graphs) -> bool | str:
    """``graphs`` if it is True, False or ``"auto"``; ``TypeError`` otherwise (truthy strings included)."""
    if graphs is True or graphs is False or (type(graphs) is str and graphs == "auto"):
        return graphs
    raise TypeError(f"graphs must be True, False or 'auto', got {type(graphs).__name__} {graphs!r}")


def checkpoint_function(config: OffloadConfig | None = None, *, graphs: bool | str = False, **config_fields):
    """The checkpoint function that ``enable_gradient_checkpointing`` (and so ``apply``) installs, its options
    checked here: ``graphed_checkpoint`` with ``graphs=True`` (``policy="auto"`` with ``graphs="auto"``), else
    ``offloaded_checkpoint`` (``fastft.offload.gradient_checkpointing_func`` for the default configuration),
    configured by ``config`` or ``OffloadConfig`` fields as keywords; ``ValueError`` for both, ``TypeError``
    for ``graphs`` not True, False or ``"auto"``."""
    if config is not None and config_fields:
        raise ValueError("give either config or OffloadConfig fields as keywords, not both")
    check_offload_config(config, "config")
    graphs_arg(graphs)
    config = config or OffloadConfig(**config_fields)
    if graphs == "auto":
        return functools.partial(graphed_checkpoint, offload_config=config, policy="auto")
    if graphs:
        return functools.partial(graphed_checkpoint, offload_config=config)
    if config == OffloadConfig():
        return gradient_checkpointing_func
    return functools.partial(offloaded_checkpoint, offload_config=config)


def enable_gradient_checkpointing(
    model, config: OffloadConfig | None = None, *, graphs: bool | str = False, **config_fields
):
    """Turn on a transformers model's gradient checkpointing with offloaded checkpoints; returns the model.

    Every layer's checkpoint function becomes ``fastft.offload.gradient_checkpointing_func`` (an
    ``offloaded_checkpoint``; ``config`` or ``OffloadConfig`` fields as keywords configure it), or with
    ``graphs=True`` ``fastft.graphs.graphed_checkpoint`` (each layer's forward and recompute + backward
    replayed as CUDA graphs; ``graphs="auto"``: its ``policy="auto"``, graphs only for launch-bound layers),
    and PEFT's frozen inputs require grad as with ``model.gradient_checkpointing_enable()``.

    The model's checkpointing switch keeps fastft's function from then on: ``Trainer`` (with
    ``gradient_checkpointing=True``), TRL and PEFT call ``gradient_checkpointing_enable`` (or, from
    transformers 5.24, ``activation_checkpointing_enable``) again, which would otherwise put torch's checkpoint
    back on every layer. Either spelling's ``every_n_layers`` and checkpoint options (``preserve_rng_state``,
    ``context_fn``, ``determinism_check``, ``debug``) are honoured. ``offload=True`` (transformers' own
    offload: ``save_on_cpu`` around torch's checkpoint, copies on the compute stream) is what fastft's
    checkpoint does already, on a side stream, as ``OffloadConfig`` configures it. ``use_reentrant=True`` is
    ignored with a warning: the offload works through the non-reentrant checkpoint (which also keeps DDP and
    frozen-input LoRA working). ``revert(model)`` gives the model back its own checkpointing.
    """
    func = checkpoint_function(config, graphs=graphs, **config_fields)
    inner = transformers_model(model)
    if not inner.supports_gradient_checkpointing:
        raise ValueError(f"{type(inner).__name__} does not support gradient checkpointing")
    lifecycle.watch(inner)  # no checkpoint in a forward without a backward (generation, evaluation)
    state = model_state(inner)
    if "checkpointing" not in state.records:
        before = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in _layers(inner)]
        had_input_grads = bool(getattr(inner, "_require_grads_hooks", None))
        state.add("checkpointing", {}, functools.partial(_restore, inner, before, had_input_grads))
    state.records["checkpointing"].update(func=func, graphs=graphs, config=config or OffloadConfig(**config_fields))
    for name, method in SPELLINGS.items():
        if hasattr(type(inner), name):
            setattr(inner, name, types.MethodType(method, inner))
    _checkpointing_enable(inner)
    return model


def _layers(inner):
    return [m for m in inner.modules() if hasattr(m, "gradient_checkpointing")]


def _checkpointing_enable(self, checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False):
    """``gradient_checkpointing_enable`` and ``activation_checkpointing_enable`` of a model under
    ``enable_gradient_checkpointing``: transformers' own (input grads, which layers), then fastft's
    checkpoint function on every checkpointed layer (see there)."""
    if type(every_n_layers) is not int or every_n_layers < 1:
        raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    options = dict(checkpointing_kwargs or {})
    if options.pop("use_reentrant", False):
        warnings.warn(
            "checkpointing with use_reentrant=True on a model with fastft's offloaded checkpointing: fastft keeps "
            "its non-reentrant checkpoint (call fastft.integrations.transformers.revert(model) first for torch's "
            "reentrant one)",
            stacklevel=2,
        )
    if getattr(self, "_require_grads_hooks", None):  # transformers would register its input-grad hooks again
        self.disable_input_require_grads()
    versions.enable_checkpointing(self, every_n_layers)
    record = model_state(self).records["checkpointing"]
    record["options"] = options
    func = functools.partial(record["func"], **options) if options else record["func"]
    self._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
    memory.install(self)  # with a memory plan: each checkpointed layer's function from its planner


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers: int = 1, offload=False):
    _checkpointing_enable(self, gradient_checkpointing_kwargs, every_n_layers, offload)


def _activation_checkpointing_enable(
    self, activation_checkpointing_kwargs=None, every_n_layers: int = 1, offload: bool = False
):
    _checkpointing_enable(self, activation_checkpointing_kwargs, every_n_layers, offload)


# the model's checkpointing switches (transformers 5.24 added the second) -> fastft's, with their keyword names
SPELLINGS = {
    "gradient_checkpointing_enable": _gradient_checkpointing_enable,
    "activation_checkpointing_enable": _activation_checkpointing_enable,
}


def _restore(inner, before, had_input_grads) -> None:
    """Undo ``enable_gradient_checkpointing``: the model's own method, and each layer's checkpoint flag and
    function, and the input-grad hooks, as they were."""
    for name in SPELLINGS:
        inner.__dict__.pop(name, None)
    for module, enabled, func in before:
        module.gradient_checkpointing = enabled
        if func is None:
            module.__dict__.pop("_gradient_checkpointing_func", None)
        else:
            module._gradient_checkpointing_func = func
    if not had_input_grads:
        inner.disable_input_require_grads()
