"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over a transformers model in one call, with the layout
choices that decide how it scales.

    import fastft.integrations.transformers as ft_hf
    from fastft.integrations.fsdp import shard

    model = ft_hf.apply(peft.get_peft_model(model, lora_config))   # on every rank, after init_process_group
    model = shard(model)          # LoRA: the frozen base stays whole on every rank, the adapters are sharded
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

``layout``:

- ``"trainable"``: only the trainable parameters are sharded; the frozen ones (a LoRA base) stay whole on every
  rank, as loaded: never gathered, never reduced (they get no gradient). The model is one FSDP2 unit: the
  adapters are gathered once before the forward and their gradients reduce-scattered once after the backward
  (a unit per layer pays FSDP2's per-unit cost, collectives and host work, for a few megabytes each: measured
  in docs/benchmarks.md). Each step moves the adapters only, so it scales like DDP, at the memory of a whole frozen
  base per GPU and a share of the adapters' optimizer state.
- ``"full"``: every parameter sharded, as ``fully_shard`` alone does: full fine-tuning, or a frozen base too
  large for one GPU. Each layer's weights are gathered before its forward, and again before its backward
  (the recompute) unless ``reshard_after_forward=False``.
- ``"auto"`` (default): ``"trainable"`` when some parameters are frozen, else ``"full"``.

``reshard_after_forward`` (default: False for ``"trainable"``, whose gathered adapters are small; True for
``"full"``): whether a unit frees its gathered weights after its forward (memory) or keeps them until its
backward (one all-gather fewer). Under ``"full"`` each decoder layer is one FSDP2 unit and the model the root
unit, which always keeps its weights (embeddings, norm, head: its backward comes first); ``prefetch`` (default
1): each decoder layer starts the all-gather of the next ``prefetch`` layers in forward order, and in backward
of the ones before it (explicit prefetch; 0 leaves FSDP2's implicit one, which only starts a gather once the
CPU reaches that layer). ``"trainable"`` has one unit: nothing to prefetch. fastft's expert-parallel experts
(``use_expert_parallel``) are left to expert parallelism (``ignored_params``) by itself. ``mesh``: FSDP2's
device mesh (None: every rank of the default group; a 2-D ``(replicate, shard)`` mesh gives HSDP, e.g.
whole copies across nodes and shards within each node).
"""

from __future__ import annotations

from .._checks import int_arg
from .models import decoder_layers, transformers_model

__all__ = ["shard", "LAYOUTS"]

LAYOUTS = ("auto", "trainable", "full")


def shard(
    model,
    mesh=None,
    *,
    layout: str = "auto",
    reshard_after_forward: bool | None = None,
    prefetch: int = 1,
    mp_policy=None,
    ignored_params=None,
):
    """FSDP2 over a transformers model (or a PEFT model around one) after ``fastft.integrations.transformers.
    apply``; returns the model, now an ``FSDPModule`` (see the module docstring for the choices). Call it on
    every rank, after ``init_process_group`` (and ``use_expert_parallel`` if used), before the optimizer.
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (e.g. ``param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32``); ``ignored_params``: parameters to leave out of FSDP2 besides those the layout
    leaves out.

    ``TypeError`` for anything but a transformers model, a ``reshard_after_forward`` that is not a bool or
    None, a non-int ``prefetch``, an ``ignored_params`` that is not a collection of parameters;
    ``ValueError`` for an unknown ``layout``, a negative ``prefetch``, a model without decoder layers, a
    ``"full"`` layout of a model whose parameters are all left out, or torch.distributed not set up."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    transformers_model(model)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True, False or None, got {reshard_after_forward!r}")
    prefetch = int_arg("prefetch", prefetch, minimum=0)
    ignored = set()
    if ignored_params is not None:
        try:
            ignored = set(ignored_params)
        except TypeError:
            raise TypeError(
                f"ignored_params must be a collection of parameters, got {type(ignored_params).__name__}"
            ) from None
        if not all(isinstance(p, torch.nn.Parameter) for p in ignored):
            raise TypeError("ignored_params must hold torch.nn.Parameter objects only")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("shard needs torch.distributed initialised (init_process_group)")
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers (transformers GradientCheckpointingLayer)")
    from .transformers.expert_parallel import expert_parameters

    ignored |= expert_parameters(model)
    params = list(model.parameters())
    if layout == "auto":
        layout = "trainable" if any(not p.requires_grad for p in params) else "full"
    if layout == "trainable":
        ignored |= {p for p in params if not p.requires_grad}
    elif all(p in ignored for p in params):
        raise ValueError("layout='full' with every parameter in ignored_params: nothing to shard")
    if reshard_after_forward is None:
        reshard_after_forward = layout == "full"
    options = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), ignored_params=ignored or None)
    if layout == "trainable":
        return fully_shard(model, reshard_after_forward=reshard_after_forward, **options)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, reshard_after_forward=False, **options)
    if prefetch:
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + prefetch])
            layer.set_modules_to_backward_prefetch(layers[max(i - prefetch, 0) : i][::-1])
    return model
