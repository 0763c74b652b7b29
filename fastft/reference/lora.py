"""Reference LoRA linear: the specification ``fastft.lora.lora_linear`` is tested against.

It is PEFT's vanilla LoRA forward: the frozen base layer in the input's dtype, the adapter path in the
adapters' dtype (PEFT keeps adapters in fp32 by default), the sum cast back to the base output's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``x @ weight.T + bias + scaling * (x @ lora_a.T) @ lora_b.T``; ``weight`` ``[out, in]``, ``lora_a``
    ``[r, in]``, ``lora_b`` ``[out, r]``."""
    base = F.linear(x, weight, bias)
    low_rank = F.linear(F.linear(x.to(lora_a.dtype), lora_a), lora_b) * scaling
    return (base + low_rank).to(base.dtype)
