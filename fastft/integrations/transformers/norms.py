"""A model's RMSNorm layers through ``fastft.rms_norm``: ``use_rms_norm(model)``.

transformers spells RMSNorm in a few ways, each copied into many model files. fastft reads each norm class's
forward (and its ``_norm``) and takes the forms whose math is ``fastft.rms_norm``'s:

- Llama's (Qwen3, Mistral, Mamba-2 hybrids and most others): ``self.weight * (x * r).to(input_dtype)`` with
  ``variance_epsilon``: where the weight has the input's dtype (else the product is promoted, and fastft
  steps aside); it rounds ``x * r`` once more than fastft does (one unit in the last place);
- OLMo-2's and Helium's: ``(self.weight * x * r).to(input_dtype)``;
- Gemma's and Qwen3.5's / Qwen3-Next's: ``(x * r * (1 + weight)).type_as(x)`` with ``eps`` (``offset=1``);
- Moshi's: the same without the 1.

In a training forward (train mode, not a forward the model runs on its own code: ``generate``, evaluation),
each such norm runs ``fastft.rms_norm``: one kernel each way instead of a chain of fp32 elementwise kernels
and their saved copies. Any other forward, a weight on another device or sharded (FSDP2's ``DTensor``), an
input dtype the op does not take: the class's forward. Norms of other forms keep theirs, and ``apply`` says
which. The forward set is a bound method on each instance; ``revert`` removes it.
"""

from __future__ import annotations

import functools

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


@functools.cache
def norm_form(cls) -> tuple[str, float, bool] | None:
    """(eps attribute, offset, whether the weight must have the input's dtype) of a norm class whose forward
    is ``fastft.rms_norm``'s math, or None."""
    forward = body(cls.forward)
    if forward is None:
        return None
    norm = body(cls._norm) if "self._norm(" in forward and hasattr(cls, "_norm") else None
    return _FORMS.get((forward, norm))


def is_rms_norm(module) -> bool:
    """Whether ``module`` is a transformers RMSNorm layer (by its class name), Liger's excepted."""
    cls = type(module)
    return cls.__name__.endswith("RMSNorm") and not (cls.__module__ or "").startswith("liger_kernel")


def _norm_forward(self, *args, **kwargs):
    """A norm's forward under ``use_rms_norm`` (bound to the norm): ``fastft.rms_norm`` of its one input in a
    training forward, else its class's forward."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return type(self).forward(self, *args, **kwargs)
    (hidden_states,) = args
    eps_name, offset, same_dtype = norm_form(type(self))
    weight = self.weight
    if (
        not self.training
        or stepping_aside()
        or hidden_states.dtype not in _DTYPES
        or weight.dtype not in _DTYPES
        or (same_dtype and weight.dtype != hidden_states.dtype)
        or weight.device != hidden_states.device
        or type(weight).__name__ == "DTensor"
    ):
        return type(self).forward(self, hidden_states)
    return rms_norm(hidden_states, weight, getattr(self, eps_name), offset=offset)


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
        if "forward" in module.__dict__ or norm_form(type(module)) is None:
            left.add(type(module).__name__)
            continue
        patch_forward(module, _norm_forward)
        taken.append(module)

    def undo():
        unpatch_forwards(taken, _norm_forward)

    result = (len(taken), sorted(left))
    state.add("norms", result, undo)
    return result
