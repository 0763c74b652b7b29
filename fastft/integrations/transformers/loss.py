"""A causal LM's training loss through ``fastft.linear_cross_entropy``: ``use_linear_cross_entropy(model)``.

transformers' causal-LM forward computes ``logits = self.lm_head(hidden_states[:, slice_indices, :])`` for
every token, then ``self.loss_function(logits=logits, labels=labels, ...)`` (``ForCausalLMLoss``: fp32
logits, labels shifted by one token, mean or sum over ``num_items_in_batch``). In a training forward with
labels (train mode, grad on, no KV cache), fastft's forward wrapper has the head hand its input on instead of
the logits, and the loss function computes ``ForCausalLMLoss`` from it through ``linear_cross_entropy``: the
logits of all tokens never exist at once. That forward's output has ``logits=None`` (the loss is all a
training step reads; Liger-Kernel's fused loss does the same). Any other forward (no labels, eval mode,
``no_grad``, generation) runs as it would without ``apply``, logits included.

The model's forward, its head's and its ``loss_function`` are bound methods set on the instances (PEFT's tuner
calls ``model.forward`` itself, past any hook; a deep copy of the model binds them to the copy). A model it
cannot serve exactly keeps its own loss, with a warning that says why: a forward that changes the logits
between the head and the loss other than by a number it holds (Granite's and Cohere's scaling, the op's
``logit_scale``) or a soft cap it holds (Gemma's ``final_logit_softcapping``, the op's ``softcap``), a head
that is not a plain ``nn.Linear`` (a PEFT adapter or a quantized head), a config vocabulary that is not the
head's, a loss function other than ``ForCausalLMLoss``, a forward or loss function already set on the instance
by another library. ``revert`` undoes it.
"""

from __future__ import annotations

import functools
import inspect
import math
import re
import types
import warnings

import torch

from ...linear_cross_entropy import linear_cross_entropy
from ..models import model_state, stepping_aside, transformers_model
from . import versions

PENDING = "_fastft_loss_pending"  # in the head's __dict__ during a fused forward: its _Pending

# What a causal-LM forward may do between its head and its loss for the fused loss to be exact (comments dropped,
# whitespace collapsed): nothing, an fp32 or contiguous copy of the logits (exact), the head's input cast to its
# dtype first, or the logits multiplied or divided by a number the model holds (``self.<attributes>``: Granite's
# ``config.logits_scaling``, Cohere's ``logit_scale``, Falcon-H1's ``model.lm_head_multiplier``); then the logits
# soft-capped by a number the model holds (Gemma's ``config.final_logit_softcapping`` where it is not None,
# RecurrentGemma's ``config.logits_soft_cap``).
_SCALE = r" (?P<op{0}>[*/]) (?P<scale{0}>self(?:\.\w+)+)"
_HEAD = (
    r"logits = self\.lm_head\(hidden_states(?:\[:, slice_indices, :\])?"
    r"(?:\.to\((?:dtype=)?self\.lm_head\.weight\.dtype\))?\)"
)
_BETWEEN = re.compile(
    _HEAD
    + r"(?:\.float\(\)|\.contiguous\(\)|"
    + _SCALE.format(1)
    + r"| logits = logits"
    + _SCALE.format(2)
    + r")?"
    + r"(?: if (?P<cap>self(?:\.\w+)+) is not None: logits = logits / (?P=cap) logits = torch\.tanh\(logits\)"
    + r" logits = logits \* (?P=cap)"
    + r"| cap = (?P<cap2>self(?:\.\w+)+) logits = nn\.functional\.tanh\(logits / cap\) \* cap)?"
    + r" loss = None if labels is not None: loss =$"
)
_COMMENT = re.compile(r"#[^\n]*")


def _between(cls) -> str | None:
    """The source of ``cls.forward`` from its head's call to its loss function's (comments dropped, whitespace
    collapsed), or None where it has no such lines."""
    try:
        source = inspect.getsource(inspect.unwrap(cls.forward))
    except (OSError, TypeError):
        return None
    start = source.find("logits = self.lm_head(")
    end = -1 if start < 0 else source.find("self.loss_function(", start)
    return None if end < 0 else " ".join(_COMMENT.sub("", source[start:end]).split())


@functools.cache
def _logit_scale(cls) -> tuple[str, tuple[str, ...]] | None:
    """(``"*"`` or ``"/"``, the attribute path from the model) of the number ``cls.forward`` scales its logits
    by, or None."""
    found = _BETWEEN.match(_between(cls) or "")
    for i in (1, 2):
        if found is not None and found.group(f"scale{i}") is not None:
            return found.group(f"op{i}"), tuple(found.group(f"scale{i}").split(".")[1:])
    return None


@functools.cache
def _softcap_path(cls) -> tuple[tuple[str, ...], bool] | None:
    """(the attribute path from the model, whether it may be None: no cap) of the soft cap ``cls.forward``
    applies, or None."""
    found = _BETWEEN.match(_between(cls) or "")
    for group, optional in (("cap", True), ("cap2", False)):
        if found is not None and found.group(group) is not None:
            return tuple(found.group(group).split(".")[1:]), optional
    return None


class _Pending:
    """One fused forward: the head's input, once the head has run, and whether the loss took it."""

    __slots__ = ("hidden", "used")

    def __init__(self):
        self.hidden = None
        self.used = False


def blocker(model) -> str | None:
    """Why ``model``'s loss cannot go through ``linear_cross_entropy`` exactly (None if it can)."""
    inner = transformers_model(model)
    name = type(inner).__name__
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        return f"{name} has no output head"
    for module, what in ((inner, "model"), (head, "head")):
        if "forward" in module.__dict__:
            return f"{name}'s {what} has a forward set on the instance (another library's patch)"
    if "_loss_function" in inner.__dict__:
        return f"{name} has a loss function set on the instance"
    if type(head) is not torch.nn.Linear:
        return f"{name}'s head is a {type(head).__name__}, not a plain nn.Linear (a PEFT adapter or a quantized head)"
    between = _between(type(inner))
    if between is None:
        return f"{name}'s forward does not compute its loss with self.loss_function from self.lm_head's logits"
    if not _BETWEEN.match(between):
        return f"{name}'s forward changes the logits between its head and its loss ({between[:120]}...)"
    try:
        _scale_of(inner)
        _softcap_of(inner)
    except (AttributeError, TypeError, ValueError) as error:
        return f"{name}'s logits: {error}"
    from transformers.loss.loss_utils import LOSS_MAPPING

    if inner.loss_function is not LOSS_MAPPING["ForCausalLM"]:
        loss = getattr(inner.loss_function, "__name__", inner.loss_function)
        return f"{name}'s loss function is {loss}, not ForCausalLMLoss"
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    vocab = getattr(config, "vocab_size", None)
    if vocab != head.out_features:
        return f"{name}'s config.vocab_size {vocab} is not its head's {head.out_features} rows"
    return None


def _without_logits(output):
    """``output`` as the forward would return it with ``logits=None`` (a ``ModelOutput`` leaves out a None
    field; a tuple is ``(loss, logits, ...)``)."""
    if isinstance(output, tuple):
        return output[:1] + output[2:]
    return type(output)(**{key: value for key, value in output.items() if key != "logits"})


def _labels(forward, model, args, kwargs):
    """The ``labels`` a forward call passes, by keyword or by position."""
    if "labels" in kwargs or not args:
        return kwargs.get("labels")
    try:
        return _signature(forward).bind_partial(model, *args, **kwargs).arguments.get("labels")
    except TypeError:
        return None


@functools.cache
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def _held(model, path: tuple[str, ...]):
    """``model``'s attribute at ``path`` (``("config", "logits_scaling")``: ``model.config.logits_scaling``)."""
    for name in path:
        model = getattr(model, name)
    return model


def _checked(value, path: tuple[str, ...], positive: bool, expected: str) -> float:
    """``value`` (held at ``path``) as a float if finite and nonzero (positive where asked), else a ``ValueError``
    saying it is not ``expected``."""
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or not (value > 0 if positive else value != 0):
        raise ValueError(f"{'.'.join(('self', *path))} is {value!r}, not {expected}")
    return float(value)


def _scale_of(model) -> float | None:
    """The number ``model``'s forward multiplies its logits by (the inverse of a divisor), or None."""
    found = _logit_scale(type(model))
    if found is None:
        return None
    op, path = found
    value = _checked(_held(model, path), path, False, "a finite nonzero number")
    return 1.0 / value if op == "/" else value


def _softcap_of(model) -> float | None:
    """The soft cap ``model``'s forward applies to its logits (None where it applies none)."""
    found = _softcap_path(type(model))
    if found is None:
        return None
    path, optional = found
    value = _held(model, path)
    if value is None and optional:
        return None
    return _checked(value, path, True, "None or a finite positive number" if optional else "a finite positive number")


def _head_forward(self, hidden):
    """A head's forward under ``use_linear_cross_entropy`` (bound to the head): in a fused forward, its input
    handed on, once; else its class's forward."""
    pending = self.__dict__.get(PENDING)
    if pending is None or pending.hidden is not None:
        return type(self).forward(self, hidden)
    pending.hidden = hidden
    return hidden


def _loss_function(
    self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """The model's ``loss_function`` (bound to it): ``ForCausalLMLoss``, from the head's input through
    ``linear_cross_entropy`` in a fused forward."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = self.get_output_embeddings()
    pending = head.__dict__.get(PENDING)
    if pending is None or pending.hidden is None:
        return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
    hidden = pending.hidden
    if logits.shape != hidden.shape:
        raise RuntimeError(
            f"fastft's fused loss got {tuple(logits.shape)} where the head's input {tuple(hidden.shape)} was "
            "expected: apply(model, loss=False) keeps the model's own loss"
        )
    if type(head.weight).__name__ == "DTensor":
        raise RuntimeError(
            f"{type(self).__name__}'s head is an FSDP2 unit of its own, its weight sharded again once its forward "
            "returns: keep the head in the root unit (fastft.integrations.fsdp.shard does), or apply(model, "
            "loss=False)"
        )
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shift_labels.to(hidden.device),
        head.bias,
        ignore_index=ignore_index,
        reduction="sum" if num_items_in_batch is not None else "mean",
        logit_scale=_scale_of(self),
        softcap=_softcap_of(self),
    )
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    pending.used = True
    return loss


@functools.cache
def _fused_forward(cls, forward):
    """``forward`` (``cls``'s, as it is now) under ``use_linear_cross_entropy``, to bind to a model: a training
    forward with labels through the fused loss, any other as ``forward`` (whose signature it shows)."""

    @functools.wraps(forward)
    def fused_forward(self, *args, **kwargs):
        head = self.get_output_embeddings()
        if (
            not self.training
            or not torch.is_grad_enabled()
            or stepping_aside()
            or PENDING in head.__dict__
            or versions.cache_of(kwargs) is not None
            or _labels(forward, self, args, kwargs) is None
        ):
            return forward(self, *args, **kwargs)
        pending = head.__dict__[PENDING] = _Pending()
        try:
            output = forward(self, *args, **kwargs)
        finally:
            head.__dict__.pop(PENDING, None)
        if pending.hidden is None:
            return output  # the head did not run (a forward that returns no logits)
        if not pending.used:
            raise RuntimeError(
                f"{cls.__name__}'s head ran but its loss did not take fastft's fused path; "
                "apply(model, loss=False) keeps the model's own loss"
            )
        return _without_logits(output)

    return fused_forward


def use_linear_cross_entropy(model) -> bool:
    """Route ``model``'s training loss through ``linear_cross_entropy`` (see the module docstring); returns
    whether it did (a model it cannot serve exactly warns and keeps its own). Once per model. The forwards and
    the loss function set are bound methods: a deep copy of the model (a reference model) runs its own."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "loss" in state.records:
        return state.records["loss"]
    why = blocker(inner)
    if why is not None:
        warnings.warn(
            f"fastft keeps the model's own loss ({why}): its forward computes the loss as it would without apply",
            RuntimeWarning,
            stacklevel=3,
        )
        state.add("loss", False, lambda: None)
        return False
    head = inner.get_output_embeddings()
    fused = (
        (head, "forward", _head_forward),
        (inner, "_loss_function", _loss_function),
        (inner, "forward", _fused_forward(type(inner), type(inner).forward)),
    )
    for module, name, fn in fused:
        module.__dict__[name] = types.MethodType(fn, module)

    def undo():  # what is still fastft's (a library that patched the instance since keeps its own)
        for module, name, fn in fused:
            if getattr(module.__dict__.get(name), "__func__", None) is fn:
                del module.__dict__[name]

    state.add("loss", True, undo)
    return True
