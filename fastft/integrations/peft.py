"""PEFT integration: LoRA linear layers through ``fastft.lora.lora_linear``, and LoRA on MoE experts'
weights (``target_parameters``) through fastft's experts path without forming ``W + B A``.

    model = peft.get_peft_model(model, config)
    fastft.integrations.peft.use_lora(model)   # or fastft.integrations.transformers.apply(model)

Each PEFT LoRA ``Linear`` keeps its modules, parameters and state dict; only its forward changes, and only
for plain LoRA: one active adapter, no dropout, no DoRA or other variant, no LoRA bias, not merged,
adapters enabled, an ``nn.Linear`` base layer with frozen weights of the input's dtype (or a bitsandbytes
4-bit base computing in the input's dtype: QLoRA, dequantized in forward and backward), no autocast, no
``adapter_names``, no weight that is still a ``DTensor`` at forward (an adapter that is an FSDP2 unit of its
own, or tensor parallelism). Anything else runs PEFT's own forward.

LoRA on the experts: PEFT's ``ParamWrapper`` (one per targeted weight, nested, around a transformers experts
block) registers ``W + scaling * B A`` as a parametrization of the weight for each forward (and recompute),
a tensor the size of every expert's weight. The outermost wrapper's forward is routed instead to the block's
fastft forward (``experts_forward``, keyword ``EXPERT_LORA_KWARG``) with the adapters as per-expert
``fastft.experts.ExpertLoRA`` views (``lora_A.weight [E*r, in]`` is expert-major; ``lora_B.weight
[out, r*E]`` holds expert ``e`` in columns ``e::E``), so that only the low-rank products over routed rows
run. Only for: the block on fastft's experts path (``use_moe``; else PEFT's path on whatever implementation
the model has), the up (gate-up) and down weights targeted, one active adapter (several: PEFT's path, with a
warning), not merged, adapters enabled, no autocast, no extra arguments, weights in fp32/bf16/fp16, no
``DTensor``. PEFT refuses ``lora_dropout``, DoRA and LoRA bias on ``target_parameters`` itself. peft is
imported only by the functions here.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from ..experts import ExpertLoRA
from ..lora import lora_linear
from .models import is_experts_block, stepping_aside

__all__ = ["use_lora", "revert_lora", "has_lora"]


def _plain_adapter(layer, x: torch.Tensor, args, kwargs):
    """The active adapter's name if ``lora_linear`` computes exactly this layer's LoRA, else None."""
    if (
        args
        or kwargs
        or layer.disable_adapters
        or layer.merged
        or not x.is_floating_point()
        or torch.is_autocast_enabled(x.device.type)
    ):
        return None
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    base, lora_b, dropout = layer.base_layer, layer.lora_B[name], layer.lora_dropout[name]
    if name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False) or lora_b.bias is not None:
        return None
    if not isinstance(dropout, torch.nn.Identity) and not (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    ):
        return None
    if base_weight(base, x) is None:
        return None
    if base.bias is not None and (base.bias.requires_grad or base.bias.dtype != x.dtype):
        return None
    if any(_is_dtensor(t) for t in (base.weight, layer.lora_A[name].weight, lora_b.weight)):
        return None  # sharded (an FSDP2 unit of its own, unsharded by its own forward only; or tensor parallel)
    return name


def base_weight(base, x: torch.Tensor):
    """The frozen weight of a LoRA layer's ``base`` as ``lora_linear`` takes it for input ``x``: the tensor
    of a plain ``nn.Linear`` of ``x``'s dtype, a function dequantizing a bitsandbytes 4-bit ``Linear4bit``
    (QLoRA) whose compute dtype is ``x``'s, or None (PEFT's forward then runs)."""
    weight = base.weight
    if type(base) is torch.nn.Linear:
        return weight if not weight.requires_grad and weight.dtype == x.dtype else None
    if type(base).__name__ == "Linear4bit" and type(base).__module__.startswith("bitsandbytes"):
        state = getattr(weight, "quant_state", None)
        if state is None or weight.requires_grad or getattr(base, "compute_dtype", None) not in (None, x.dtype):
            return None
        return functools.partial(_dequantize_4bit, weight, state, x.dtype)
    return None


def _dequantize_4bit(weight, state, dtype: torch.dtype) -> torch.Tensor:
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(weight.data, state).to(dtype)


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = None if stepping_aside() else _plain_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    return lora_linear(
        x, base_weight(base, x), base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    )


_EXPERT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # PEFT upcasts others (fp8) to add B A


def _param_wrapper():
    """PEFT's ``ParamWrapper`` class (``target_parameters``), or None in a PEFT without it."""
    from peft.tuners.lora import layer

    return getattr(layer, "ParamWrapper", None)


def _expert_adapters(wrapper, x: torch.Tensor, args, kwargs):
    """``(experts block, {weight name: ExpertLoRA})`` if fastft's experts path computes exactly the LoRA of
    these nested ``ParamWrapper``s (``wrapper`` the outermost), else None."""
    from .transformers.experts import EXPERTS_IMPLEMENTATION, lora_weights

    if kwargs or len(args) != 2 or not x.is_floating_point() or torch.is_autocast_enabled(x.device.type):
        return None
    chain, block, wrapper_cls = [], wrapper, _param_wrapper()
    while isinstance(block, wrapper_cls):
        chain.append(block)
        block = block.base_layer
    if getattr(getattr(block, "config", None), "_experts_implementation", None) != EXPERTS_IMPLEMENTATION:
        return None  # the user's own experts implementation: PEFT's path on it
    adapters = {}
    for layer in chain:
        if layer.disable_adapters or layer.merged or layer.parameter_name not in lora_weights(block):
            return None
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) > 1:
            warnings.warn(
                f"{len(active)} active LoRA adapters on {layer.parameter_name}: PEFT's forward, which forms "
                "W + B A for every expert (fastft's experts path takes one active adapter)",
                stacklevel=3,
            )
            return None
        if not active:
            continue
        name = active[0]
        param, lora_a, lora_b = layer.get_param(), layer.lora_A[name].weight, layer.lora_B[name].weight
        if (
            name in getattr(layer, "lora_variant", {})
            or layer.use_dora.get(name, False)
            or layer.lora_B[name].bias is not None
            or not isinstance(layer.lora_dropout[name], torch.nn.Identity)
            or param.dim() != 3
            or param.dtype not in _EXPERT_DTYPES
            or any(_is_dtensor(t) for t in (param, lora_a, lora_b))
        ):
            return None
        experts = layer.num_experts
        adapters[layer.parameter_name] = ExpertLoRA(
            lora_a.reshape(experts, -1, lora_a.shape[-1]),  # [E, r, in]
            lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1),  # [E, out, r]
            layer.scaling[name],
        )
    return (block, adapters) if adapters else None


def _experts_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    from .transformers.experts import EXPERT_LORA_KWARG

    found = None if stepping_aside() else _expert_adapters(self, x, args, kwargs)
    if found is None:
        return type(self).forward(self, x, *args, **kwargs)
    block, adapters = found
    return block(x, *args, **{EXPERT_LORA_KWARG: adapters})  # the block's hooks run, as under PEFT's forward


def _is_peft_4bit(module) -> bool:
    """PEFT's LoRA layer on a bitsandbytes 4-bit base (``peft.tuners.lora.bnb.Linear4bit``, not a subclass of
    its ``Linear``; found by name, so that bitsandbytes is never imported here)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__ == "peft.tuners.lora.bnb"


def _lora_layers(model) -> tuple[list, list]:
    """PEFT LoRA ``Linear`` layers, and the outermost ``ParamWrapper`` around each transformers experts block."""
    from peft.tuners.lora.layer import Linear

    wrapper_cls = _param_wrapper()
    linears = [m for m in model.modules() if isinstance(m, Linear) or _is_peft_4bit(m)]
    wrappers = [m for m in model.modules() if wrapper_cls is not None and isinstance(m, wrapper_cls)]
    inner = {id(w.base_layer) for w in wrappers}
    outer = [w for w in wrappers if id(w) not in inner and is_experts_block(w.get_base_layer())]
    return linears, outer


def use_lora(model):
    """Route every PEFT LoRA ``Linear`` of ``model`` through ``lora_linear``, and the LoRA on its experts'
    weights (PEFT ``target_parameters``) through fastft's experts path (see the module docstring); returns the
    model. Raises ``ValueError`` if the model has neither."""
    linears, wrappers = _lora_layers(model)
    if not linears and not wrappers:
        raise ValueError(
            f"{type(model).__name__} has no PEFT LoRA Linear layers or LoRA on experts' weights (wrap it with "
            "peft.get_peft_model first)"
        )
    for layer in linears:
        layer.forward = types.MethodType(_forward, layer)
    for wrapper in wrappers:
        wrapper.forward = types.MethodType(_experts_forward, wrapper)
    return model


def revert_lora(model):
    """Put every PEFT LoRA layer that ``use_lora`` routed back on PEFT's forward; returns the model."""
    for layer in model.modules():
        forward = layer.__dict__.get("forward")
        if getattr(forward, "__func__", None) in (_forward, _experts_forward):
            del layer.forward
    return model


def has_lora(model) -> bool:
    """Whether ``model`` holds PEFT LoRA layers ``use_lora`` routes (False when peft is not installed)."""
    try:
        linears, wrappers = _lora_layers(model)
    except ImportError:
        return False
    return bool(linears or wrappers)
