"""A model's rotary position embeddings through ``fastft.rotary``: ``use_rotary(model)``.

Each transformers model file defines ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``, which its
attention layers call by that module-level name. fastft reads the function and takes the forms whose math is
``fastft.rotary``'s (``rotate_half`` being the usual one):

- Llama's (most models): ``q * cos + rotate_half(q) * sin``, where ``cos`` and ``sin`` have ``q``'s and ``k``'s
  dtype (else the products are promoted, and fastft steps aside);
- the partial forms (GPT-NeoX's, Phi-3's; Qwen3.5, Qwen3-Next, Bamba, GLM-4.5): the first ``cos.shape[-1]``
  channels rotated, the rest passed through;
- OLMo-2's: Llama's cast back to each input's dtype (any ``cos`` dtype);
- gpt-oss's: ``cos`` and ``sin`` of half the width, applied to both halves (``_apply_rotary_emb``);
- with ``rotate_half`` of the interleaved pairs ``(2j, 2j + 1)`` (``fastft.rotary(..., interleaved=True)``):
  Cohere's (computed in fp32, both outputs in ``q``'s dtype), and GLM's, GLM-4's, Helium's and Ernie 4.5's, which
  first repeat the first half of ``cos`` and ``sin`` pairwise (GLM's partial, Ernie's in fp32).

It installs, in place of each such function, one that calls ``fastft.rotary`` while one of the model's
attention layers runs a training forward (train mode, not a forward the model runs on its own code:
``generate``, evaluation), and the function it replaced otherwise: other models in the process, other
forwards, arguments of another shape, ``cos`` requiring grad. Each attention layer's forward is a bound method
on the instance that marks its call. ``fastft.rotary`` rounds once where transformers rounds each product and
the sum. Attention layers whose function is of another form keep it, and ``apply`` names their classes
(Liger-Kernel's rotary, where it replaced the function, is left as it is). ``revert`` removes the marks, and
the installed function once no model uses it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading

import torch

from ...rotary import rotary
from ..models import model_state, patch_forward, stepping_aside, transformers_model, unpatch_forwards
from .source import body

NAME = "apply_rotary_pos_emb"
_ROTATE_HALF = "x1 = x[..., : x.shape[-1] // 2] x2 = x[..., x.shape[-1] // 2 :] return torch.cat((-x2, x1), dim=-1)"
_HEAD = "cos = cos.unsqueeze(unsqueeze_dim) sin = sin.unsqueeze(unsqueeze_dim) "
_FULL = "q_embed = (q * cos) + (rotate_half(q) * sin) k_embed = (k * cos) + (rotate_half(k) * sin) "
_REPEAT = (
    "cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1) sin = sin[..., : sin.shape[-1] // 2]"
    ".repeat_interleave(2, dim=-1) "
)
_ROTARY_DIM = (
    "rotary_dim = cos.shape[-1] q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:] k_rot, k_pass = "
    "k[..., :rotary_dim], k[..., rotary_dim:] "
)
_PARTIAL_CAT = (
    "q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin) k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin) "
    "q_embed = torch.cat([q_embed, q_pass], dim=-1) k_embed = torch.cat([k_embed, k_pass], dim=-1) return q_embed, "
    "k_embed"
)


@dataclasses.dataclass(frozen=True)
class Form:
    partial: bool  # cos may rotate fewer channels than the heads have
    cast: bool  # the outputs are cast back to the inputs' dtypes (so cos may have another dtype)
    halves: bool = False  # cos and sin hold one half's angles, for both halves (gpt-oss)
    repeat: bool = False  # cos's and sin's first half repeated pairwise first (GLM, Helium, Ernie 4.5)
    one_dtype: bool = False  # both outputs in q's dtype (Cohere, Ernie 4.5): q and k must share it
    interleaved: bool = False  # rotate_half pairs the channels (2j, 2j + 1): set from the module's rotate_half


_FORMS = {
    _HEAD + _FULL + "return q_embed, k_embed": Form(partial=False, cast=False),
    _HEAD + _ROTARY_DIM + _PARTIAL_CAT: Form(partial=True, cast=False),
    _HEAD + _ROTARY_DIM + "q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1) k_embed = "
    "torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1) return q_embed, k_embed": Form(
        partial=True, cast=False
    ),
    "q_type, k_type = q.dtype, k.dtype " + _HEAD + _FULL + "return q_embed.to(q_type), k_embed.to(k_type)": Form(
        partial=False, cast=True
    ),
    _HEAD + "q_embed = _apply_rotary_emb(q, cos, sin) k_embed = _apply_rotary_emb(k, cos, sin) return q_embed, "
    "k_embed": Form(partial=False, cast=False, halves=True),
    "dtype = q.dtype q = q.float() k = k.float() " + _HEAD + _FULL + "return q_embed.to(dtype=dtype), "
    "k_embed.to(dtype=dtype)": Form(partial=False, cast=True, one_dtype=True),
    _HEAD + _REPEAT + _ROTARY_DIM + _PARTIAL_CAT: Form(partial=True, cast=False, repeat=True),
    _HEAD + _REPEAT + _FULL + "return q_embed, k_embed": Form(partial=False, cast=False, repeat=True),
    "original_dtype = q.dtype " + _HEAD + _REPEAT + "q_embed = (q.float() * cos) + (rotate_half(q).float() * sin) "
    "k_embed = (k.float() * cos) + (rotate_half(k).float() * sin) return q_embed.to(original_dtype), "
    "k_embed.to(original_dtype)": Form(partial=False, cast=True, repeat=True, one_dtype=True),
}
_ROTATE_PAIRS = {  # rotate_half of the interleaved pairs, each spelling
    "x1 = x[..., ::2] x2 = x[..., 1::2] rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2) return rot_x",
    "x1 = x[..., 0::2] x2 = x[..., 1::2] return torch.stack((-x2, x1), dim=-1).flatten(-2)",
}
_APPLY_HALVES = (
    "first_half, second_half = torch.chunk(x, 2, dim=-1) first_ = first_half * cos - second_half * sin second_ = "
    "second_half * cos + first_half * sin return torch.cat((first_, second_), dim=-1)"
)
_PARAMETERS = ("q", "k", "cos", "sin", "unsqueeze_dim")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_marked = threading.local()  # per thread: how many attention layers' training forwards are under way
_installed: dict[int, list] = {}  # id(namespace) -> [namespace, the function replaced, models using it]


@functools.cache
def rotary_form(fn) -> Form | None:
    """The form of an ``apply_rotary_pos_emb`` whose math is ``fastft.rotary``'s, or None."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if tuple(parameters) != _PARAMETERS or parameters["unsqueeze_dim"].default != 1:
        return None
    form = _FORMS.get(body(fn))
    if form is None:
        return None
    found = getattr(fn, "__globals__", {}).get("_apply_rotary_emb" if form.halves else "rotate_half")
    text = body(found) if found is not None else None
    if form.halves:
        return form if text == _APPLY_HALVES else None
    if text == _ROTATE_HALF:
        return form
    return dataclasses.replace(form, interleaved=True) if text in _ROTATE_PAIRS else None


def _takes(form: Form, q, k, cos, sin, unsqueeze_dim) -> bool:
    """Whether ``fastft.rotary`` computes what the replaced function would of these arguments."""
    if unsqueeze_dim != 1 or not all(type(t) is torch.Tensor for t in (q, k, cos, sin)):
        return False
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape:
        return False
    if cos.requires_grad or sin.requires_grad:
        return False
    batch, _, tokens, width = q.shape
    r = cos.shape[-1] * (2 if form.halves else 1)
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, tokens, width):
        return False
    if cos.shape[:2] not in ((batch, tokens), (1, tokens)):
        return False
    if r % 2 or not 0 < r <= width or (r != width and not form.partial):
        return False
    dtypes = {q.dtype, k.dtype, cos.dtype, sin.dtype}
    if not dtypes <= set(_DTYPES) or (not form.cast and len(dtypes) > 1):
        return False
    if form.one_dtype and q.dtype != k.dtype:
        return False
    return len({t.device for t in (q, k, cos, sin)}) == 1


def _dispatcher(original, form: Form):
    """The function installed in place of ``original``: ``fastft.rotary`` inside a marked attention forward
    when it computes the same, else ``original``."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if getattr(_marked, "depth", 0) > 0 and _takes(form, q, k, cos, sin, unsqueeze_dim):
            if form.halves:
                cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
            elif form.repeat:
                cos, sin = (t[..., : t.shape[-1] // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
            return rotary(q, k, cos, sin, interleaved=form.interleaved)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.fastft_replaced = original
    return apply_rotary_pos_emb


def _attention_forward(self, *args, **kwargs):
    """An attention layer's forward under ``use_rotary`` (bound to the layer): its class's forward, marked as a
    training forward where it is one."""
    if not self.training or stepping_aside():
        return type(self).forward(self, *args, **kwargs)
    depth = getattr(_marked, "depth", 0)
    _marked.depth = depth + 1
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        _marked.depth = depth


def _namespace(cls) -> dict | None:
    """The module globals in which ``cls.forward`` looks up ``apply_rotary_pos_emb``, if it calls it."""
    forward = body(cls.forward)
    if forward is None or f"{NAME}(" not in forward:
        return None
    return getattr(inspect.unwrap(cls.forward), "__globals__", None)


def _install(namespace: dict, original, form: Form) -> None:
    entry = _installed.get(id(namespace))
    if entry is None:
        entry = _installed[id(namespace)] = [namespace, original, 0]
        namespace[NAME] = _dispatcher(original, form)
    entry[2] += 1


def _uninstall(namespace: dict) -> None:
    entry = _installed[id(namespace)]
    entry[2] -= 1
    if entry[2] == 0:
        del _installed[id(namespace)]
        if getattr(namespace.get(NAME), "fastft_replaced", None) is entry[1]:  # still fastft's
            namespace[NAME] = entry[1]


def use_rotary(model) -> tuple[int, list[str]]:
    """Run ``model``'s rotary embeddings of a form fastft takes through ``fastft.rotary`` in its attention layers'
    training forwards (see the module docstring). Returns how many attention layers, and the names of those
    left on their own ``apply_rotary_pos_emb``. Once per model; ``revert`` undoes it."""
    inner = transformers_model(model)
    state = model_state(inner)
    if "rotary" in state.records:
        return state.records["rotary"]
    taken, left, namespaces = [], set(), {}
    for module in inner.modules():
        namespace = _namespace(type(module))
        if namespace is None:
            continue
        fn = namespace.get(NAME)
        original = getattr(fn, "fastft_replaced", fn)
        if (getattr(original, "__module__", None) or "").startswith("liger_kernel"):
            continue  # Liger's own rotary kernel
        form = rotary_form(original) if original is not None else None
        if "forward" in module.__dict__ or form is None:
            left.add(type(module).__name__)
            continue
        namespaces[id(namespace)] = (namespace, original, form)
        patch_forward(module, _attention_forward)
        taken.append(module)
    for namespace, original, form in namespaces.values():
        _install(namespace, original, form)

    def undo():
        unpatch_forwards(taken, _attention_forward)
        for namespace, _, _ in namespaces.values():
            _uninstall(namespace)

    result = (len(taken), sorted(left))
    state.add("rotary", result, undo)
    return result
