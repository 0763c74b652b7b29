"""A model's RMSNorm layers through ``fastft.rms_norm``: ``use_rms_norm(model)``.

transformers spells RMSNorm in a few ways, each copied into many model files. fastft reads each norm class's
forward (and its ``_norm``) and takes the forms whose math is ``fastft.rms_norm``'s:

- Llama's (Qwen3, Mistral, Mamba-2 hybrids and most others): ``self.weight * (x * r).to(input_dtype)`` with
  ``variance_epsilon``: where the weight has the input's dtype (else the product is promoted, and fastft
  steps aside); it rounds ``x * r`` once more than fastft does (one unit in the last place);
- OLMo-2's and Helium's: ``(self.weight * x * r).to(input_dtype)``;
- Gemma's and Qwen3.5's / Qwen3-Next's: ``(x * r * (1 + weight)).type_as(x)`` with ``eps`` (``offset=1``);
- Moshi's: the same without the 1;
- the gated norms of the linear-attention and state-space mixers (``norm(x, gate)``): Qwen3.5's, Qwen3-Next's
  and OLMo-Hybrid's (the gate's activation after the norm, ``self.weight * x.to(input_dtype)`` rounded once
  more), the same with the weight in fp32 (Kimi-Linear's), each where ``self.activation`` is SiLU or a sigmoid;
  Mamba-2's, Bamba's and Granite-4.0-H's (``silu(gate)`` before the norm, or no gate), where the weight has the
  input's dtype, and the same in groups of ``group_size`` channels (Zamba2's and Nemotron-H's; Mamba-2's,
  Bamba's and Granite-4.0-H's from transformers 5.24); Falcon-H1's (groups of ``n_groups``, ``silu(gate)``
  after the norm or before it by ``norm_before_gate``, one rounding), on 2-d and 3-d inputs.

In a training forward (train mode, not a forward the model runs on its own code: ``generate``, evaluation),
each such norm runs ``fastft.rms_norm``: one kernel each way instead of a chain of fp32 elementwise kernels
and their saved copies. Any other forward, a weight on another device or sharded (FSDP2's ``DTensor``), an
input dtype the op does not take: the class's forward. Norms of other forms keep theirs, and ``apply`` says
which. The forward set is a bound method on each instance; ``revert`` removes it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ...rms_norm import rms_norm
from ..models import model_state, patch_forward, stepping_aside, transformers_model, unpatch_forwards
from .source import body

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PROLOGUE = (
    "input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
    "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon) "
)
_NORM = "return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)"
# forward body (and ``_norm``'s, where it calls it) -> (eps attribute, offset, the weight must have x's dtype)
_FORMS = {
    (_PROLOGUE + "return self.weight * hidden_states.to(input_dtype)", None): ("variance_epsilon", 0.0, True),
    (_PROLOGUE + "return (self.weight * hidden_states).to(input_dtype)", None): ("variance_epsilon", 0.0, False),
    (_PROLOGUE + "return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)", None): (
        "variance_epsilon",
        0.0,
        False,
    ),
    (
        "output = self._norm(x.float()) output = output * (1.0 + self.weight.float()) return output.type_as(x)",
        _NORM,
    ): ("eps", 1.0, False),
    ("output = self._norm(x.float()) output = output * self.weight.float() return output.type_as(x)", _NORM): (
        "eps",
        0.0,
        False,
    ),
}


_GATED = (
    "input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) variance = "
    "hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon) hidden_states = {weight} hidden_states = hidden_states * "
    "ACT2FN[self.activation](gate.to(torch.float32)) return hidden_states.to(input_dtype)"
)
_GATE_FIRST = (
    "input_dtype = hidden_states.dtype hidden_states = hidden_states.to(torch.float32) if gate is not None: "
    "hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32)) {norm} "
    "return self.weight * hidden_states.to(input_dtype)"
)
_WHOLE = (
    "variance = hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * torch.rsqrt(variance + "
    "self.variance_epsilon)"
)
_GROUPS = (  # Zamba2's, Nemotron-H's (and transformers 5.24's Mamba-2's): groups of ``self.group_size`` channels
    "*prefix_dims, last_dim = hidden_states.shape group_count = last_dim // self.group_size hidden_states_group = "
    "hidden_states.view(*prefix_dims, group_count, self.group_size) variance = hidden_states_group.pow(2).mean(-1, "
    "keepdim=True) hidden_states_group = hidden_states_group * torch.rsqrt(variance + self.variance_epsilon) "
    "hidden_states = hidden_states_group.view(*prefix_dims, group_count * self.group_size)"
)
_FALCON = (  # Falcon-H1's (transformers 5.24's: Nemotron-H's too): ``n_groups``, the gate before or after the norm
    "input_dtype = hidden_states.dtype {ndim}if not self.norm_before_gate and gate is not None: hidden_states = "
    "hidden_states * F.silu(gate.to(torch.float32)) if len(hidden_states.shape) == 3: batch_size, seq_len, dim = "
    "hidden_states.shape else: batch_size, dim = hidden_states.shape seq_len = 1 hidden_states = "
    "hidden_states.to(torch.float32) hidden_states = hidden_states.view(batch_size, seq_len, self.n_groups, int(dim "
    "// self.n_groups)) variance = hidden_states.pow(2).mean(-1, keepdim=True) hidden_states = hidden_states * "
    "torch.rsqrt(variance + self.variance_epsilon) hidden_states = self.weight.view(self.n_groups, int(dim // "
    "self.n_groups)) * hidden_states hidden_states = hidden_states.view(batch_size, seq_len, dim) if {squeeze}: "
    "hidden_states = hidden_states.squeeze(1) if self.norm_before_gate and gate is not None: hidden_states = "
    "hidden_states * F.silu(gate.to(torch.float32)) return hidden_states.to(input_dtype)"
)


class Gated(NamedTuple):
    """How a gated norm class's forward reads as ``fastft.rms_norm``."""

    eps: str  # the eps attribute
    same_dtype: bool  # the weight must have the input's dtype
    gate_first: bool | None  # the gate's place (None: after the norm unless ``self.norm_before_gate`` is false)
    groups: str | None  # ``group_size`` (channels a group), ``n_groups`` (groups a row) or None (the whole row)
    activation: bool  # the gate's activation is ``self.activation`` (else SiLU)
    squeezes_one_token: bool = False  # a 3-d input of one token comes back 2-d (transformers 5.17's Falcon-H1)


_GATED_FORMS = {
    _GATED.format(weight="self.weight * hidden_states.to(input_dtype)"): Gated(
        "variance_epsilon", False, False, None, True
    ),
    _GATED.format(weight="self.weight.to(torch.float32) * hidden_states"): Gated(
        "variance_epsilon", False, False, None, True
    ),
    _GATE_FIRST.format(norm=_WHOLE): Gated("variance_epsilon", True, True, None, False),
    _GATE_FIRST.format(norm=_GROUPS): Gated("variance_epsilon", True, True, "group_size", False),
    _FALCON.format(ndim="", squeeze="seq_len == 1"): Gated("variance_epsilon", False, None, "n_groups", False, True),
    _FALCON.format(ndim="input_ndim = hidden_states.ndim ", squeeze="input_ndim == 2"): Gated(
        "variance_epsilon", False, None, "n_groups", False
    ),
}
# a gated form's ``self.activation`` -> fastft.rms_norm's gate_activation
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


@functools.cache
def norm_form(cls) -> tuple[str, float, bool] | None:
    """(eps attribute, offset, whether the weight must have the input's dtype) of a norm class whose forward
    is ``fastft.rms_norm``'s math, or None."""
    forward = body(cls.forward)
    if forward is None:
        return None
    norm = body(cls._norm) if "self._norm(" in forward and hasattr(cls, "_norm") else None
    return _FORMS.get((forward, norm))


@functools.cache
def gated_form(cls) -> Gated | None:
    """How a gated norm class's forward (``forward(hidden_states, gate)``) is ``fastft.rms_norm``'s math with
    its ``gate``, or None."""
    forward = body(cls.forward)
    return None if forward is None else _GATED_FORMS.get(forward)


def _gate_activation(module, form: Gated) -> str | None:
    """The gate's activation of a gated form (fastft.rms_norm's name), or None where fastft has not that one:
    the module's ``activation`` (SiLU or sigmoid) where the form reads it, else SiLU."""
    return _ACTIVATIONS.get(getattr(module, "activation", None)) if form.activation else "silu"


def _gate_first(module, form: Gated) -> bool | None:
    """Whether the module's gate comes before its norm (None: an attribute that is not a bool)."""
    if form.gate_first is not None:
        return form.gate_first
    before = getattr(module, "norm_before_gate", None)
    return None if not isinstance(before, bool) else not before


def _group_size(module, form: Gated, width: int) -> int | None:
    """Channels a group of the module's norm over rows of ``width`` (the width itself for a whole-row form), or
    None where its attributes do not cut the rows into whole groups (the class's forward raises or differs)."""
    if form.groups is None:
        return width
    value = getattr(module, form.groups, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or width % value:
        return None
    return value if form.groups == "group_size" else width // value


def _takes(module) -> bool:
    """Whether fastft takes ``module``'s forward: a plain form, or a gated one gated by SiLU or a sigmoid in
    whole groups of its weight."""
    if norm_form(type(module)) is not None:
        return True
    form = gated_form(type(module))
    if form is None or _group_size(module, form, module.weight.shape[-1]) is None:
        return False
    return _gate_activation(module, form) is not None and _gate_first(module, form) is not None


def is_rms_norm(module) -> bool:
    """Whether ``module`` is a transformers RMSNorm layer, gated or not (by its class name), Liger's excepted."""
    cls = type(module)
    return cls.__name__.endswith(("RMSNorm", "RMSNormGated")) and not (cls.__module__ or "").startswith("liger_kernel")


def _norm_forward(self, *args, **kwargs):
    """A norm's forward under ``use_rms_norm`` (bound to the norm): ``fastft.rms_norm`` of its input (and a
    gated norm's gate) in a training forward, else its class's forward."""
    form = norm_form(type(self))
    group_size = None
    if form is not None:
        if len(args) != 1 or kwargs:
            return type(self).forward(self, *args, **kwargs)
        (hidden_states,), gate, gate_first, activation = args, None, False, "silu"
    else:
        gated = gated_form(type(self))
        form = gated.eps, 0.0, gated.same_dtype
        given = dict(zip(("hidden_states", "gate"), args), **kwargs)
        if len(args) > 2 or set(given) - {"hidden_states", "gate"} or "hidden_states" not in given:
            return type(self).forward(self, *args, **kwargs)
        hidden_states, gate = given["hidden_states"], given.get("gate")
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() == 0:
            return type(self).forward(self, *args, **kwargs)
        width = hidden_states.shape[-1]
        group_size, gate_first = _group_size(self, gated, width), _gate_first(self, gated)
        if group_size is None or gate_first is None:  # attributes changed since apply
            return type(self).forward(self, *args, **kwargs)
        if gated.groups == "n_groups" and (  # Falcon-H1's: 2-d or 3-d input
            hidden_states.dim() not in (2, 3)
            or (gated.squeezes_one_token and hidden_states.dim() == 3 and hidden_states.shape[1] == 1)
        ):
            return type(self).forward(self, *args, **kwargs)
        if gate is None and not gate_first and gated.groups != "n_groups":  # the form needs a gate after the norm
            return type(self).forward(self, *args, **kwargs)
        if gate is not None and (
            not isinstance(gate, torch.Tensor) or gate.dtype not in _DTYPES or gate.shape != hidden_states.shape
        ):
            return type(self).forward(self, *args, **kwargs)
        activation = _gate_activation(self, gated)
        if activation is None:  # an activation set on the module since apply
            return type(self).forward(self, *args, **kwargs)
        gate_first = gate_first and gate is not None
        group_size = None if group_size == width else group_size
    eps_name, offset, same_dtype = form
    weight = self.weight
    if (
        not isinstance(hidden_states, torch.Tensor)
        or not self.training
        or stepping_aside()
        or hidden_states.dtype not in _DTYPES
        or weight.dtype not in _DTYPES
        or (same_dtype and weight.dtype != hidden_states.dtype)
        or weight.device != hidden_states.device
        or (gate is not None and gate.device != hidden_states.device)
        or type(weight).__name__ == "DTensor"
    ):
        return type(self).forward(self, *args, **kwargs)
    eps = getattr(self, eps_name)
    return rms_norm(
        hidden_states, weight, eps, offset=offset, gate=gate, gate_first=gate_first, gate_activation=activation,
        group_size=group_size,
    )  # fmt: skip


def use_rms_norm(model) -> tuple[int, list[str]]:
    """Run ``model``'s RMSNorm layers of a form fastft takes through ``fastft.rms_norm`` in training forwards
    (see the module docstring). Returns how many, and the names of the RMSNorm classes left on their own
    forward. Once per model; ``revert`` undoes it."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "norms" in state.records:
        return state.records["norms"]
    taken, left = [], set()
    for module in inner.modules():
        if not is_rms_norm(module):
            continue
        if "forward" in module.__dict__ or not _takes(module):
            left.add(type(module).__name__)
            continue
        patch_forward(module, _norm_forward)
        taken.append(module)

    def undo():
        unpatch_forwards(taken, _norm_forward)

    result = (len(taken), sorted(left))
    state.add("norms", result, undo)
    return result
