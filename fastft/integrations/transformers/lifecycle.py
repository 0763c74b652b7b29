"""Which forwards of a model under ``apply`` fastft serves; the model's own code runs the others.

A forward of the decoder stack is one of three kinds (``forward_kind``):

- ``TRAIN``: train mode, grad enabled, no KV cache: everything ``apply`` turned on (packed attention and
  mixers, fastft's experts and LoRA, its checkpoint, offload and graphs).
- ``PACKED``: no grad or eval mode, no KV cache and no padding mask, documents given by ``position_ids`` (or
  the collator's ``cu_seq_lens_q``): a padding-free evaluation batch, or a policy's log-probabilities under
  ``no_grad``. fastft's packed attention and mixers keep the documents apart (the model's own may not); no
  layer is checkpointed (no backward will replay it), and a model with recurrent mixers builds no cache.
- ``STOCK``: any other forward: ``generate`` (a KV cache, or the first step that builds one: ``use_cache``
  on rows that are one document each), evaluation or inference on plain or padded rows.
  The model runs as it would without ``apply``: the attention and experts implementations it had, PEFT's
  LoRA forward, Liger's experts, no checkpoint (transformers 5.17 drops the cache of a checkpointed layer
  in train mode). Its logits and tokens are the model's without ``apply``. Under ``use_expert_parallel``
  the experts stay on fastft's path (the only one that runs a rank's slice of them; every rank generates
  in step, as it trains).

``watch(model)`` registers the decoder stack's hooks that set each forward up and put everything back
after it (also when it raises); ``forward_kind(stack)`` tells the other concerns' hooks the current kind.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch

from ..models import decoder_stack, model_state, step_aside, transformers_model
from . import versions
from .mixer_ops import CALL_KWARGS

TRAIN, PACKED, STOCK = "train", "packed", "stock"
KIND = "fastft_forward"  # in the decoder stack's __dict__ during a forward: its _Forward


@dataclasses.dataclass
class _Forward:
    kind: str
    configs: list  # (config, backing attribute, fastft's value) to put back after a stock forward
    layers: list  # the layers whose checkpointing was turned off for this forward


def classify(stack: torch.nn.Module, kwargs: dict) -> str:
    """The kind of a decoder-stack forward called with ``kwargs`` (see the module docstring)."""
    if versions.cache_of(kwargs) is not None:
        return STOCK
    if stack.training and torch.is_grad_enabled():
        return TRAIN
    if kwargs.get("attention_mask") is not None:
        return STOCK
    position_ids = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is not None:
        return PACKED
    if position_ids is None:
        return STOCK
    if _builds_cache(stack, kwargs) and _one_document_per_row(position_ids):
        return STOCK  # generate's first step: the cache the next steps continue from is the model's own
    return PACKED


def _builds_cache(stack: torch.nn.Module, kwargs: dict) -> bool:
    use_cache = kwargs.get("use_cache")
    return bool(getattr(getattr(stack, "config", None), "use_cache", False) if use_cache is None else use_cache)


def _one_document_per_row(position_ids: torch.Tensor) -> bool:
    """Positions that only rise along each row (one host sync, taken only where a cache would be built)."""
    return bool((position_ids[..., 1:] > position_ids[..., :-1]).all())


def forward_kind(stack: torch.nn.Module) -> str:
    """The kind of the decoder stack's forward under way (``TRAIN`` outside ``watch``'s hooks)."""
    current = stack.__dict__.get(KIND)
    return current.kind if current is not None else TRAIN


def _backing(config, attribute: str) -> str:
    """The attribute that holds a config's ``attribute`` (transformers keeps implementations behind a property
    whose setter also sets every sub-config)."""
    return attribute + "_internal" if isinstance(getattr(type(config), attribute, None), property) else attribute


def configs_of(config) -> list:
    """``config`` and its sub-configs, recursively, each once."""
    found, todo = [], [config]
    while todo:
        c = todo.pop()
        if c is None or any(c is f for f in found):
            continue
        found.append(c)
        todo.extend(getattr(c, key, None) for key in getattr(c, "sub_configs", {}) or {})
    return found


def snapshot(inner, attribute: str) -> list:
    """(config, value) of ``attribute`` on every config of the model: take it before fastft sets its own."""
    return [(c, getattr(c, _backing(c, attribute), None)) for c in configs_of(inner.config)]


def own(inner, attribute: str, before: list) -> None:
    """Record that fastft set ``attribute`` (``"_attn_implementation"``, ``"_experts_implementation"``) on the
    model's configs, which ``before`` (``snapshot``) holds as they were: a stock forward runs with those."""
    swaps = model_state(inner).records.setdefault("stock", {})
    for config, value in before:
        backing = _backing(config, attribute)
        if getattr(config, backing, None) != value:
            swaps[(id(config), backing)] = (config, backing, value)


def _begin(module, kwargs, inner) -> None:
    _finish(module)  # a forward that raised before the hook below ran
    held = CALL_KWARGS.get()  # the boundaries a causal LM that hands its stack none was called with (Mamba's)
    kind = classify(module, {**held, **kwargs} if held else kwargs)
    if kind == TRAIN:
        return None
    layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    configs = []
    if kind == STOCK:
        state = model_state(inner)
        sharded = "expert_parallel" in state.records  # each rank holds its slice of the experts: fastft's runs them
        for config, backing, value in state.records.get("stock", {}).values():
            if sharded and backing.startswith("_experts_implementation"):
                continue
            configs.append((config, backing, getattr(config, backing)))
            setattr(config, backing, value)
        step_aside(+1)
    module.__dict__[KIND] = _Forward(kind, configs, layers)


def _finish(module, *_) -> None:
    current = module.__dict__.pop(KIND, None)
    if current is None:
        return
    for layer in current.layers:
        layer.gradient_checkpointing = True
    for config, backing, value in current.configs:
        setattr(config, backing, value)
    if current.kind == STOCK:
        step_aside(-1)


def watch(model) -> None:
    """The decoder stack's hooks that set up each forward by its kind and put everything back after it
    (once per model; ``revert`` removes them)."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "lifecycle" in state.records:
        return
    stack = decoder_stack(model)
    ref = weakref.ref(inner)  # the hook lives on a module of the model: no reference cycle through it

    def begin_forward(module, args, kwargs):
        _begin(module, kwargs, ref())

    begin = stack.register_forward_pre_hook(begin_forward, with_kwargs=True, prepend=True)
    finish = stack.register_forward_hook(_finish, always_call=True)

    def undo():
        _finish(stack)
        begin.remove()
        finish.remove()

    state.add("lifecycle", None, undo)
