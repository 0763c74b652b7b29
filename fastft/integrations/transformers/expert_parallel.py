"""fastft's expert parallelism for transformers models: each rank keeps its own tokens and a slice of every
experts block's experts (``use_expert_parallel``), the experts' forward goes through
``fastft.moe_expert_parallel``, and ``revert`` gathers the full experts back."""

from __future__ import annotations

import functools

import torch

from ...expert_parallel import group_rank_size
from .. import liger
from ..models import experts_blocks, has_experts, model_state, transformers_model
from .experts import EXPERT_SHARD, EXPERTS_IMPLEMENTATION, ExpertShard


def use_expert_parallel(model, group=None):
    """Expert parallelism with fastft's all-to-all path (``fastft.moe_expert_parallel``) over ``group``
    (None: the default group, which it must span); returns the model.

    Every rank keeps its own tokens (data parallel) and each experts block keeps only this rank's
    ``E / W`` experts (rank ``r``: ``[r E/W, (r+1) E/W)``, sliced from the full weights every rank loaded).
    Call it on every rank after ``apply`` (or ``use_moe``) and before ``DistributedDataParallel``: the expert
    weights are left out of DDP's broadcast and gradient all-reduce (they differ per rank) whether DDP wraps
    ``model``, a PEFT wrapper's LoRA model or the transformers model inside it, and their
    gradients, which sum every rank's loss, are divided by ``W`` to be the gradient of the mean of the
    ranks' losses, as DDP gives the other parameters. With FSDP2, pass ``expert_parameters(model)`` to
    ``fully_shard(..., ignored_params=...)``. ``revert(model)`` gathers the full experts back (a collective).

    Unlike transformers' own expert-parallel plan (``DistributedConfig(enable_expert_parallel=True)``: the
    same tokens on every rank, each rank's experts' partial outputs all-reduced), ranks here do not repeat
    each other's attention and send only routed rows.

    ``TypeError`` for anything but a transformers model (or a PEFT model around one); ``ValueError`` for a
    model without experts blocks, Liger-Kernel's ``LigerExperts`` blocks, experts not on fastft's path
    (``apply`` not called), LoRA on the experts (PEFT ``target_parameters``, or another parametrization),
    a group smaller than the world, experts that do not split over the group, experts transformers' plan
    sharded already, or a second call."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import parametrize

    inner = transformers_model(model)
    if any(liger.is_liger_experts(m) for m in inner.modules()):
        raise ValueError(
            "expert parallelism does not take Liger-Kernel's LigerExperts blocks: build the model without Liger's "
            "swiglu, or apply Liger to the model instance (its instance forwards are taken off by apply)"
        )
    if not has_experts(inner):
        raise ValueError(f"{type(inner).__name__} has no experts blocks: expert parallelism has nothing to split")
    if getattr(inner.config, "_experts_implementation", None) != EXPERTS_IMPLEMENTATION:
        raise ValueError("use_expert_parallel needs fastft's experts path: call apply(model) (or use_moe) first")
    blocks = experts_blocks(inner)
    wrapped = {id(m.base_layer) for m in inner.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Module)}
    if any(id(b) in wrapped or parametrize.is_parametrized(b) for b in blocks):
        raise ValueError(
            "expert parallelism does not take LoRA on the experts yet (PEFT target_parameters, or another "
            "parametrization of the experts' weights): put LoRA on the other layers only"
        )
    state = model_state(inner)
    if "expert_parallel" in state.records:
        raise ValueError("use_expert_parallel was already called on this model")
    rank, world = group_rank_size(group)
    if world != dist.get_world_size():
        raise ValueError(
            f"the expert-parallel group has {world} of {dist.get_world_size()} ranks; a group spanning the world "
            "is supported (experts replicated over several groups are not yet)"
        )
    for block in blocks:
        num_experts = block.down_proj.shape[0]
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        if any(isinstance(p, DTensor) for p in block.parameters(recurse=False)):
            raise ValueError("the experts are sharded already (transformers' expert-parallel plan): use one of the two")
    for block in blocks:
        num_experts = block.down_proj.shape[0]
        names = tuple(n for n, p in block.named_parameters(recurse=False) if p.dim() and p.shape[0] == num_experts)
        local = num_experts // world
        for name in names:
            full = getattr(block, name)
            part = torch.nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone(), full.requires_grad)
            if part.requires_grad and world > 1:
                part.register_hook(functools.partial(torch.div, other=world))
            setattr(block, name, part)
        params = tuple(getattr(block, n) for n in names)
        block.__dict__[EXPERT_SHARD] = ExpertShard(group, rank, world, num_experts, names, params)
    mine = {id(p) for p in expert_parameters(model)}
    previous = []  # (module DDP may wrap, its ignore list before)
    # DDP reads the ignore list of the module it wraps: the PEFT wrapper, its LoRA model or the transformers
    # model. Without it, DDP's first broadcast would overwrite every rank's experts with rank 0's.
    for wrap in {id(m): m for m in (model, getattr(model, "base_model", model), inner)}.values():
        before = list(getattr(wrap, "_ddp_params_and_buffers_to_ignore", []))
        ignore = [n for n, p in wrap.named_parameters() if id(p) in mine]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrap, before + ignore)
        previous.append((wrap, before))
    state.add("expert_parallel", blocks, functools.partial(gather_experts, blocks, previous))
    return model


def expert_parameters(model) -> set:
    """The expert weights ``use_expert_parallel`` sliced (this rank's own; for FSDP2's ``ignored_params``).
    ``TypeError`` for anything but a transformers model (or a PEFT model around one)."""
    shards = [m.__dict__[EXPERT_SHARD] for m in transformers_model(model).modules() if EXPERT_SHARD in m.__dict__]
    return {p for shard in shards for p in shard.params}


def gather_experts(blocks, previous) -> None:
    """Undo ``use_expert_parallel`` (a collective): every rank gets the full expert weights of ``blocks``
    back, and each module DDP may wrap its ignore list before (``previous``: (module, list) pairs)."""
    import torch.distributed as dist

    for block in blocks:
        shard = block.__dict__.pop(EXPERT_SHARD)
        for name in shard.names:
            part = getattr(block, name).detach().contiguous()
            parts = [torch.empty_like(part) for _ in range(shard.world)]
            dist.all_gather(parts, part, group=shard.group)
            setattr(block, name, torch.nn.Parameter(torch.cat(parts), getattr(block, name).requires_grad))
    for wrap, before in previous:
        wrap._ddp_params_and_buffers_to_ignore = before
