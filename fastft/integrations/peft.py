"""PEFT integration: LoRA linear layers through ``fastft.lora.lora_linear``.

    model = peft.get_peft_model(model, config)
    fastft.integrations.peft.use_lora(model)   # or fastft.integrations.transformers.apply(model)

Each PEFT LoRA ``Linear`` keeps its modules, parameters and state dict; only its forward changes, and only
for plain LoRA: one active adapter, no dropout, no DoRA or other variant, no LoRA bias, not merged,
adapters enabled, an ``nn.Linear`` base layer with frozen weights of the input's dtype, no autocast, no
``adapter_names``, no weight that is still a ``DTensor`` at forward (an adapter that is an FSDP2 unit of its
own, or tensor parallelism). Anything else runs PEFT's own forward. peft is imported only by the functions here.
"""

from __future__ import annotations

import types

import torch

from ..lora import lora_linear


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
    if type(base) is not torch.nn.Linear or base.weight.requires_grad or base.weight.dtype != x.dtype:
        return None
    if base.bias is not None and (base.bias.requires_grad or base.bias.dtype != x.dtype):
        return None
    if any(_is_dtensor(t) for t in (base.weight, layer.lora_A[name].weight, lora_b.weight)):
        return None  # sharded (an FSDP2 unit of its own, unsharded by its own forward only; or tensor parallel)
    return name


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = _plain_adapter(self, x, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    return lora_linear(
        x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    )


def use_lora(model):
    """Route every PEFT LoRA ``Linear`` of ``model`` through ``lora_linear`` (see the module docstring);
    returns the model. Raises ``ValueError`` if the model has no PEFT LoRA linear layer."""
    from peft.tuners.lora.layer import Linear

    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no PEFT LoRA Linear layers (wrap it with peft.get_peft_model first)"
        )
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return model


def revert_lora(model):
    """Put every PEFT LoRA ``Linear`` that ``use_lora`` routed back on PEFT's forward; returns the model."""
    from peft.tuners.lora.layer import Linear

    for layer in model.modules():
        forward = layer.__dict__.get("forward")
        if isinstance(layer, Linear) and getattr(forward, "__func__", None) is _forward:
            del layer.forward
    return model


def has_lora(model) -> bool:
    """Whether ``model`` holds PEFT LoRA linear layers (False when peft is not installed)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return False
    return any(isinstance(m, Linear) for m in model.modules())
