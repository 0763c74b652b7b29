"""A model's gated MLPs' activation through ``fastft.swiglu``: ``use_swiglu(model)``.

transformers spells a SwiGLU MLP ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Qwen3, Mistral, the
Mamba-2 hybrids, MoE models' shared experts and most others), or with one fused ``gate_up_proj`` split in two
(GLM, Phi-3, Granite's ``input_linear``). fastft reads each MLP class's forward and takes these forms where the
activation is SiLU, or GELU's tanh form (GeGLU: Gemma's ``gelu_pytorch_tanh``): in a training forward (train
mode, not a forward the model runs on its own code: ``generate``, evaluation) the projections run as before, in
the same order, and ``act(gate) * up`` is one ``fastft.swiglu`` kernel each way instead of two forward and three
backward, with one ``[tokens, I]`` tensor saved fewer. ``fastft.swiglu`` rounds once where the stock product
rounds twice. Any other forward, or projections whose outputs the op does not take (their dtypes differ, another
dtype, a ``DTensor``): the stock product. Gated MLPs of other forms or activations (GELU's exact form,
Falcon-H1's multipliers, clamped gates) keep their forward, and ``apply`` names their classes. The forward
set is a bound method on each instance; ``revert`` removes it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ...swiglu import swiglu
from ..models import model_state, patch_forward, stepping_aside, transformers_model, unpatch_forwards
from .source import body


@dataclasses.dataclass(frozen=True)
class Form:
    """Where a gated MLP's pieces are: the gate and up projections (or one fused ``gate_up``), its activation
    and its down projection."""

    act: str
    down: str
    gate: str = ""
    up: str = ""
    gate_up: str = ""


_PAIR = Form(act="act_fn", down="down_proj", gate="gate_proj", up="up_proj")
_FORMS = {
    "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) return down_proj": _PAIR,
    "return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))": _PAIR,
    "return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))": _PAIR,
    "down_proj = self.activation_fn(self.gate_proj(x)) * self.up_proj(x) return self.down_proj(down_proj)": Form(
        act="activation_fn", down="down_proj", gate="gate_proj", up="up_proj"
    ),
    "up_states = self.gate_up_proj(hidden_states) gate, up_states = up_states.chunk(2, dim=-1) up_states = "
    "up_states * self.activation_fn(gate) return self.down_proj(up_states)": Form(
        act="activation_fn", down="down_proj", gate_up="gate_up_proj"
    ),
    "hidden_states = self.input_linear(hidden_states) chunked_hidden_states = hidden_states.chunk(2, dim=-1) "
    "hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1] hidden_states = "
    "self.output_linear(hidden_states) return hidden_states": Form(
        act="activation", down="output_linear", gate_up="input_linear"
    ),
}
_SILU = {("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")}
# 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), each spelling (PytorchGELUTanh is an alias of GELUTanh)
_GELU_TANH = {
    ("transformers.activations", "GELUTanh"),
    ("transformers.activations", "NewGELUActivation"),
    ("transformers.activations", "FastGELUActivation"),
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def mlp_form(cls) -> Form | None:
    """Where the pieces are of a gated MLP class whose forward is one of the forms fastft takes, or None (the
    activation is checked per instance: ``activation``)."""
    forward = body(cls.forward)
    return None if forward is None else _FORMS.get(forward)


def activation(act) -> str | None:
    """``fastft.swiglu``'s name for the activation module ``act`` (torch's or transformers' SiLU: ``"silu"``;
    GELU's tanh form: ``"gelu_tanh"``), or None for any other."""
    key = (type(act).__module__, type(act).__name__)
    if key in _SILU:
        return "silu"
    if key in _GELU_TANH or (type(act) is torch.nn.GELU and act.approximate == "tanh"):
        return "gelu_tanh"
    return None


def is_gated_mlp(module) -> bool:
    """Whether ``module`` is a gated MLP (gate and up projections, or a fused one, and a down projection),
    Liger's excepted."""
    if (type(module).__module__ or "").startswith("liger_kernel"):
        return False
    if mlp_form(type(module)) is not None:
        return True
    names = set(module._modules)
    return {"gate_proj", "up_proj", "down_proj"} <= names or {"gate_up_proj", "down_proj"} <= names


def _takes(*tensors) -> bool:
    first = tensors[0]
    return all(
        t.dtype == first.dtype and t.dtype in _DTYPES and t.device == first.device and type(t) is torch.Tensor
        for t in tensors
    )


def _mlp_forward(self, *args, **kwargs):
    """A gated MLP's forward under ``use_swiglu`` (bound to the MLP): its projections, and between them
    ``fastft.swiglu`` in a training forward; else its class's forward."""
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor) or not self.training or stepping_aside():
        return type(self).forward(self, *args, **kwargs)
    (x,) = args
    form = mlp_form(type(self))
    act = getattr(self, form.act)
    name = activation(act)
    if form.gate_up:
        gate_up = getattr(self, form.gate_up)(x)
        if name and _takes(gate_up) and gate_up.shape[-1] % 2 == 0:
            hidden = swiglu(gate_up, activation=name)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = act(gate) * up
    else:
        gate = getattr(self, form.gate)(x)
        up = getattr(self, form.up)(x)
        taken = name and _takes(gate, up) and gate.shape == up.shape
        hidden = swiglu(gate, up, activation=name) if taken else act(gate) * up
    return getattr(self, form.down)(hidden)


def use_swiglu(model) -> tuple[int, list[str]]:
    """Run ``model``'s gated MLPs of a form fastft takes with SiLU or GELU's tanh form through ``fastft.swiglu``
    in training forwards (see the module docstring). Returns how many, and the names of the gated MLP classes
    left on their own forward. Once per model; ``revert`` undoes it."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "swiglu" in state.records:
        return state.records["swiglu"]
    taken, left = [], set()
    for module in inner.modules():
        if not is_gated_mlp(module):
            continue
        form = mlp_form(type(module))
        if "forward" in module.__dict__ or form is None or activation(getattr(module, form.act, None)) is None:
            left.add(type(module).__name__)
            continue
        patch_forward(module, _mlp_forward)
        taken.append(module)

    def undo():
        unpatch_forwards(taken, _mlp_forward)

    result = (len(taken), sorted(left))
    state.add("swiglu", result, undo)
    return result
