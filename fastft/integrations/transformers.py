"""Hugging Face transformers integration: packed-sequence attention, offloaded checkpointing and MoE
experts blocks from fastft, through transformers' own registries (no model code copied or edited).

    from fastft.integrations.transformers import apply
    model = apply(model)   # packing=True, offload_checkpointing=True, moe=True

- ``use_packed_attention(model)``: attention function ``"fastft"`` (transformers' attention registry):
  document boundaries from ``position_ids`` (e.g. ``DataCollatorWithFlattening``) or the collator's
  ``cu_seq_lens_q`` + ``max_length_q``, built once per forward as a ``PackedSeqInfo`` and reused by
  every layer; no document attends to another; each layer's sliding window is honoured.
- ``use_moe(model)``: experts implementation ``"fastft"`` (transformers' experts registry), see
  ``experts_forward``.
- offload: ``enable_gradient_checkpointing`` (``fastft.offloaded_checkpoint`` as the checkpoint function,
  kept when ``Trainer``/TRL/PEFT call ``gradient_checkpointing_enable`` again).
- LoRA: PEFT LoRA linear layers through ``fastft.lora.lora_linear`` (``fastft.integrations.peft``).
- ``revert(model)`` undoes all of it; what ``apply`` replaced is kept on the model for that.

transformers (5.x; tested with 5.17) is imported only by the functions here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings

import torch

from .. import capabilities
from ..attention import packed_attention
from ..expert_parallel import group_rank_size, moe_expert_parallel
from ..graphs import graphed_checkpoint
from ..offload import OffloadConfig, gradient_checkpointing_func, offloaded_checkpoint
from ..packing import packed_seq_info
from ..routing import moe_expert_rows, moe_permute, moe_route, moe_unpermute

EXPERTS_IMPLEMENTATION = "fastft"
ATTENTION_IMPLEMENTATION = "fastft"


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x`` times expert ``e``'s matrix: ``weight[e]`` (``[in, out]``) when
    ``transposed``, else ``weight[e].T`` (``weight`` is ``[E, out, in]``). ``torch._grouped_mm`` where it
    runs (CUDA bf16, aligned sizes; no host sync); otherwise one matmul per expert, which reads ``ends``
    on the host."""
    w = weight if transposed else weight.transpose(-2, -1)
    if capabilities.grouped_mm(x, weight):
        return torch._grouped_mm(x, w, offs=ends)
    starts = [0] + ends.tolist()
    rows = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, starts[1:]))]
    return torch.cat(rows + [x.new_zeros(x.shape[0] - starts[-1], w.shape[-1])])  # padding rows: 0


def routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    transposed: bool,
    activation,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """An experts block with fastft routing: ``moe_route`` (no host sync) -> ``moe_permute`` -> grouped up
    (or gate-up) projection (+ ``up_bias`` rows through ``moe_expert_rows``) -> ``activation`` -> grouped down
    projection (+ ``down_bias`` rows) -> ``moe_unpermute`` weighted by the router (fp32 sum in fixed order).
    ``hidden_states`` is ``[T, H]``; ``up``/``down`` are ``[E, out, in]`` (``[E, in, out]`` if ``transposed``);
    ``top_k_weights`` ``[T, K]`` or None (all ones). Expert ids outside ``[0, E)`` (expert-parallel sentinels)
    contribute nothing."""
    num_experts = up.shape[0]
    routing = moe_route(top_k_index, num_experts)
    ends = routing.offsets[1:]
    h = grouped_linear(moe_permute(hidden_states, routing), up, ends, transposed)
    if up_bias is not None:
        h = h + moe_expert_rows(up_bias, routing)
    out = grouped_linear(activation(h), down, ends, transposed)
    if down_bias is not None:
        out = out + moe_expert_rows(down_bias, routing)
    return moe_unpermute(out, routing, top_k_weights).to(hidden_states.dtype)


def experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """A transformers experts block's forward through ``routed_experts`` (its gate, activation and biases),
    or, after ``use_expert_parallel``, through ``fastft.moe_expert_parallel`` with this rank's experts."""
    shard = self.__dict__.get(EXPERT_SHARD)
    if shard is not None and any(getattr(self, n) is not p for n, p in zip(shard.names, shard.params)):
        raise ValueError(
            "this rank's expert weights were replaced after use_expert_parallel (FSDP2 without "
            "ignored_params=expert_parameters(model) would shard them as if every rank held the same ones)"
        )
    num_experts = shard.num_experts if shard is not None else self.down_proj.shape[0]
    tokens, top_k = top_k_index.shape
    if top_k_weights.shape == (tokens, num_experts) and top_k != num_experts:  # routers giving every weight
        top_k_weights = top_k_weights.gather(1, top_k_index.long().clamp(0, num_experts - 1))
    local = functools.partial(
        routed_experts,
        up=self.gate_up_proj if self.has_gate else self.up_proj,
        down=self.down_proj,
        transposed=self.is_transposed,
        activation=self._apply_gate if self.has_gate else self.act_fn,
        up_bias=(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None,
        down_bias=self.down_proj_bias if self.has_bias else None,
    )
    if shard is None:
        return local(hidden_states, top_k_index, top_k_weights)
    out = moe_expert_parallel(
        hidden_states,
        top_k_index,
        top_k_weights,
        lambda rows, ids: local(rows, ids, None),
        num_experts=num_experts,
        group=shard.group,
    )
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``experts_forward`` with transformers as the experts implementation ``"fastft"``."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


def use_moe(model):
    """Route every experts block of a transformers model through fastft (see ``experts_forward``); returns
    the model. Liger-Kernel's fused MoE in its place (``swiglu=True``) is replaced by fastft's path, with a
    warning, whether Liger came before or after (``fastft.integrations.liger``)."""
    from . import liger

    if not hasattr(model, "set_experts_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel with experts blocks, got {type(model).__name__}")
    if not has_experts(model):
        raise ValueError(
            f"{type(model).__name__} has no transformers experts blocks (use_experts_implementation) to route"
        )
    inner = hf_model(model)
    state = _state(inner)
    state.setdefault("experts", inner.config._experts_implementation)
    register()
    inner.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    liger.keep_fastft_experts(model, state)
    return model


# ---- expert parallelism ----------------------------------------------------------------------------------

EXPERT_SHARD = "fastft_expert_shard"  # in an experts block's __dict__ under use_expert_parallel


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """An experts block's place under ``use_expert_parallel``: the process group, this rank's index and the
    group's size, the model's global expert count, and the names and objects of the sliced parameters."""

    group: object
    rank: int
    world: int
    num_experts: int
    names: tuple[str, ...]
    params: tuple  # the sliced parameters, to notice a wrapper that replaced them (FSDP2 sharding them)


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
    each other's attention and send only routed rows. LoRA on the experts is not supported here yet."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.utils import parametrize

    from . import liger

    inner = hf_model(model)
    if any(liger.is_liger_experts(m) for m in inner.modules()):
        raise ValueError(
            "expert parallelism does not take Liger-Kernel's LigerExperts blocks: build the model without Liger's "
            "swiglu, or apply Liger to the model instance (its instance forwards are taken off by apply)"
        )
    if getattr(getattr(inner, "config", None), "_experts_implementation", None) != EXPERTS_IMPLEMENTATION:
        raise ValueError("use_expert_parallel needs fastft's experts path: call apply(model) (or use_moe) first")
    rank, world = group_rank_size(group)
    if world != dist.get_world_size():
        raise ValueError(
            f"the expert-parallel group has {world} of {dist.get_world_size()} ranks; a group spanning the world "
            "is supported (experts replicated over several groups are not yet)"
        )
    state = _state(inner)
    if "expert_parallel" in state:
        raise ValueError("use_expert_parallel was already called on this model")
    blocks = [m for m in inner.modules() if is_experts_block(m)]
    sharded = []
    for block in blocks:
        num_experts = block.down_proj.shape[0]
        if parametrize.is_parametrized(block):
            raise ValueError("expert parallelism does not take LoRA (or another parametrization) on the experts yet")
        if num_experts % world:
            raise ValueError(f"{num_experts} experts do not split over {world} ranks")
        names = tuple(n for n, p in block.named_parameters(recurse=False) if p.dim() and p.shape[0] == num_experts)
        if any(isinstance(getattr(block, n), DTensor) for n in names):
            raise ValueError("the experts are sharded already (transformers' expert-parallel plan): use one of the two")
        local = num_experts // world
        for name in names:
            full = getattr(block, name)
            part = torch.nn.Parameter(full.detach()[rank * local : (rank + 1) * local].clone(), full.requires_grad)
            if part.requires_grad:
                part.register_hook(functools.partial(torch.div, other=world))
            setattr(block, name, part)
        params = tuple(getattr(block, n) for n in names)
        block.__dict__[EXPERT_SHARD] = ExpertShard(group, rank, world, num_experts, names, params)
        sharded.append(block)
    mine = {id(p) for p in expert_parameters(model)}
    previous = []  # (module DDP may wrap, its ignore list before)
    # DDP reads the ignore list of the module it wraps: the PEFT wrapper, its LoRA model or the transformers
    # model. Without it, DDP's first broadcast would overwrite every rank's experts with rank 0's.
    for wrap in {id(m): m for m in (model, getattr(model, "base_model", model), inner)}.values():
        before = list(getattr(wrap, "_ddp_params_and_buffers_to_ignore", []))
        ignore = [n for n, p in wrap.named_parameters() if id(p) in mine]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(wrap, before + ignore)
        previous.append((wrap, before))
    state["expert_parallel"] = (sharded, previous)
    return model


def expert_parameters(model) -> set:
    """The expert weights ``use_expert_parallel`` sliced (this rank's own; for FSDP2's ``ignored_params``)."""
    shards = [m.__dict__[EXPERT_SHARD] for m in hf_model(model).modules() if EXPERT_SHARD in m.__dict__]
    return {p for shard in shards for p in shard.params}


def _gather_experts(state) -> None:
    """Undo ``use_expert_parallel``: every rank gets the full expert weights back."""
    import torch.distributed as dist

    sharded, previous = state
    for block in sharded:
        shard = block.__dict__.pop(EXPERT_SHARD)
        for name in shard.names:
            part = getattr(block, name).detach().contiguous()
            parts = [torch.empty_like(part) for _ in range(shard.world)]
            dist.all_gather(parts, part, group=shard.group)
            setattr(block, name, torch.nn.Parameter(torch.cat(parts), getattr(block, name).requires_grad))
    for wrap, before in previous:
        wrap._ddp_params_and_buffers_to_ignore = before


# ---- packed-sequence attention --------------------------------------------------------------------------

PACKED_INFO_KWARG = "fastft_packed_info"  # the forward keyword that hands each layer the batch's PackedSeqInfo


def _batch_info(batch: int, tokens: int, device, kwargs: dict):
    """The ``PackedSeqInfo`` of a ``[batch, tokens]`` batch from the model call's keyword arguments."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:  # flash kwargs of DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        max_len = kwargs.get("max_length_q")
        return packed_seq_info(
            cu_seqlens=cu,
            max_seqlen=int(max_len) if max_len is not None else None,
            num_tokens=batch * tokens,
            device=device,
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return packed_seq_info(seq_lengths=[tokens] * batch, device=device)
    if position_ids.dim() == 2 and position_ids.shape[0] != batch:  # [1, T] for a batch of plain rows
        position_ids = position_ids.expand(batch, -1)
    return packed_seq_info(position_ids=position_ids, device=device)


def attention_forward(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs
):
    """transformers attention function ``"fastft"``: ``fastft.packed_attention`` (causal attention inside
    each document only) with the layer's window, scale, dropout and attention sinks (gpt-oss).

    ``query`` is ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, T, D]``; returns (``[B, T, H, D]``, None).
    The ``PackedSeqInfo`` comes from the decoder stack's pre-hook (built once per forward, see
    ``use_packed_attention``), or from the layer's own ``position_ids`` / ``cu_seq_lens_q`` when the layer is
    called without that hook.
    """
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            "fastft packed attention needs keys for exactly the query tokens (training or prefill, no KV cache)"
        )
    info = kwargs.get(PACKED_INFO_KWARG)
    if info is None:
        info = _batch_info(query.shape[0], query.shape[2], query.device, kwargs)
    window = int(sliding_window) if sliding_window else None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = packed_attention(
        q, k, v, info, window=window, sinks=getattr(module, "sinks", None), scale=scaling, dropout_p=dropout
    )
    return out, None


def _prepare_packed_batch(module, args, kwargs):
    """Forward pre-hook of the decoder stack, once per forward: a 2D ``attention_mask`` (padding) becomes
    position ids whose padding tokens are one-token documents (no sync), since transformers passes no mask
    to a registered attention function; then the batch's ``PackedSeqInfo`` is built once and handed to
    every layer under ``PACKED_INFO_KWARG``."""
    if len(args) > 1:
        raise ValueError("with fastft packed attention, pass attention_mask and position_ids as keyword arguments")
    mask = kwargs.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError("fastft packed attention takes a 2D padding attention_mask (or none), not a prepared mask")
        keep = mask.bool()
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = keep.long().cumsum(-1) - 1
        kwargs = {**kwargs, "attention_mask": None, "position_ids": torch.where(keep, positions, 0)}
    ids = args[0] if args else kwargs.get("input_ids")
    embeds = kwargs.get("inputs_embeds")
    tokens = ids if ids is not None else embeds
    if tokens is None or kwargs.get("past_key_values") is not None:
        return args, kwargs  # nothing to describe, or generation with a cache: each layer decides
    batch, length = tokens.shape[:2]
    info = _batch_info(batch, length, tokens.device, kwargs)
    return args, {**kwargs, PACKED_INFO_KWARG: info}


def decoder_stack(model):
    """The transformers module whose forward takes ``input_ids``/``position_ids`` and calls the layers."""
    inner = hf_model(model)
    return getattr(inner, "base_model", inner)


def use_packed_attention(model):
    """Attention through ``attention_forward`` for every layer of a transformers model; returns the model.

    A 2D padding ``attention_mask`` still works: its padding tokens become documents of their own (position
    ids restart there, which shifts rotary positions of left-padded rows by a constant)."""
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    from transformers import AttentionInterface

    inner = hf_model(model)
    state = _state(inner)
    state.setdefault("attention", inner.config._attn_implementation)
    AttentionInterface.register(ATTENTION_IMPLEMENTATION, attention_forward)
    inner.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    if "packed_hook" not in state:
        state["packed_hook"] = decoder_stack(model).register_forward_pre_hook(_prepare_packed_batch, with_kwargs=True)
    return model


# ---- offloaded gradient checkpointing ---------------------------------------------------------------------


def enable_gradient_checkpointing(model, config: OffloadConfig | None = None, *, graphs: bool = False, **config_fields):
    """Turn on a transformers model's gradient checkpointing with offloaded checkpoints; returns the model.

    Every layer's checkpoint function becomes ``fastft.offload.gradient_checkpointing_func`` (an
    ``offloaded_checkpoint``; ``config`` or ``OffloadConfig`` fields as keywords configure it), or with
    ``graphs=True`` ``fastft.graphs.graphed_checkpoint`` (each layer's forward and recompute + backward
    replayed as CUDA graphs), and PEFT's frozen inputs require grad as with
    ``model.gradient_checkpointing_enable()``.

    The model's ``gradient_checkpointing_enable`` keeps fastft's function from then on: ``Trainer`` (with
    ``gradient_checkpointing=True``), TRL and PEFT call it again, which would otherwise put torch's checkpoint
    back on every layer. Their ``every_n_layers`` and checkpoint options (``preserve_rng_state``,
    ``context_fn``, ``determinism_check``, ``debug``) are honoured. ``offload=True`` (transformers' own
    offload: ``save_on_cpu`` around torch's checkpoint, copies on the compute stream) is fastft's offload
    already, so fastft's side-stream, double-buffered version stays. ``use_reentrant=True`` is ignored with a
    warning: the offload works through the non-reentrant checkpoint (which also keeps DDP and frozen-input
    LoRA working). ``revert(model)`` gives the model back its own checkpointing.
    """
    if config is not None and config_fields:
        raise ValueError("give either config or OffloadConfig fields as keywords, not both")
    if config is not None and not isinstance(config, OffloadConfig):
        raise TypeError(f"config must be a fastft.OffloadConfig or None, got {type(config).__name__}")
    if not isinstance(graphs, bool):
        raise TypeError(f"graphs must be True or False, got {graphs!r}")
    config = config or OffloadConfig(**config_fields)
    inner = hf_model(model)
    if not hasattr(inner, "gradient_checkpointing_enable") or not hasattr(inner, "_set_gradient_checkpointing"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not inner.supports_gradient_checkpointing:
        raise ValueError(f"{type(inner).__name__} does not support gradient checkpointing")
    state = _state(inner)
    if "checkpointing" not in state:
        state["checkpointing"] = (
            [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func")) for m in _gc_modules(inner)],
            bool(getattr(inner, "_require_grads_hooks", None)),
        )
    if graphs:
        state["checkpoint_func"] = functools.partial(graphed_checkpoint, offload_config=config)
    elif config == OffloadConfig():
        state["checkpoint_func"] = gradient_checkpointing_func
    else:
        state["checkpoint_func"] = functools.partial(offloaded_checkpoint, offload_config=config)
    inner.gradient_checkpointing_enable = types.MethodType(_gradient_checkpointing_enable, inner)
    inner.gradient_checkpointing_enable()
    return model


def _gc_modules(inner):
    return [m for m in inner.modules() if hasattr(m, "gradient_checkpointing")]


def _gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers: int = 1, offload=False):
    """The ``gradient_checkpointing_enable`` of a model under ``enable_gradient_checkpointing``: transformers'
    own (input grads, which layers), then fastft's checkpoint function on every layer (see there)."""
    options = dict(gradient_checkpointing_kwargs or {})
    if options.pop("use_reentrant", False):
        warnings.warn(
            "gradient_checkpointing_enable(use_reentrant=True) on a model with fastft's offloaded checkpointing: "
            "fastft keeps its non-reentrant checkpoint (call fastft.integrations.transformers.revert(model) "
            "first for torch's reentrant one)",
            stacklevel=2,
        )
    if getattr(self, "_require_grads_hooks", None):  # transformers would register its input-grad hooks again
        self.disable_input_require_grads()
    type(self).gradient_checkpointing_enable(self, {"use_reentrant": False}, every_n_layers=every_n_layers)
    func = self.__dict__[_STATE]["checkpoint_func"]
    if options:
        func = functools.partial(func, **options)
    self._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)


def is_experts_block(module) -> bool:
    """Whether ``module`` is a transformers experts block (``use_experts_implementation``)."""
    return hasattr(module, "down_proj") and hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def has_experts(model) -> bool:
    """Whether a transformers model holds experts blocks (``use_experts_implementation``)."""
    return any(is_experts_block(m) for m in model.modules())


def apply(
    model,
    *,
    packing: bool = True,
    offload_checkpointing: bool = True,
    moe: bool = True,
    lora: bool = True,
    graphs: bool = False,
):
    """fastft for a transformers model (or a PEFT model around one), in place; returns the model.
    ``packing``: ``use_packed_attention``; ``offload_checkpointing``: gradient checkpointing through
    ``fastft.offloaded_checkpoint`` (kept through later ``gradient_checkpointing_enable`` calls, e.g. by
    ``Trainer``); ``moe``: ``use_moe`` when the model has experts blocks (Liger-Kernel's included);
    ``lora``: ``fastft.integrations.peft.use_lora`` when it has PEFT LoRA layers (so call ``apply`` after
    ``peft.get_peft_model``); ``graphs``: each checkpointed layer replayed as CUDA graphs
    (``fastft.graphs.graphed_checkpoint``; needs ``offload_checkpointing``). ``revert(model)`` undoes it."""
    from . import liger
    from . import peft as ft_peft

    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(graphs, bool):
        raise TypeError(f"graphs must be True or False, got {graphs!r}")
    if graphs and not offload_checkpointing:
        raise ValueError("graphs=True needs offload_checkpointing=True: the graphs are replayed by fastft's checkpoint")
    if packing:
        use_packed_attention(model)
    if moe and has_experts(model):
        use_moe(model)
    if moe:
        liger.route_liger_experts(model, _state(hf_model(model)))
    if lora and ft_peft.has_lora(model):
        ft_peft.use_lora(model)
    if offload_checkpointing:
        enable_gradient_checkpointing(model, graphs=graphs)
    return model


def revert(model):
    """Undo ``apply`` (and ``use_packed_attention``, ``use_moe``, ``enable_gradient_checkpointing``): the
    attention and experts implementations the model had, its forward pre-hook removed, each checkpointed
    layer's checkpoint flag and function as they were (torch's, or none), PEFT LoRA layers back on PEFT's
    forward, Liger's experts blocks on Liger's, the full experts on every rank after ``use_expert_parallel``
    (a collective: call it on every rank); returns the model. ``ValueError`` if fastft set nothing."""
    from . import liger
    from . import peft as ft_peft

    inner = hf_model(model)
    state = inner.__dict__.pop(_STATE, None) if isinstance(inner, torch.nn.Module) else None
    if state is None:
        raise ValueError(f"{type(model).__name__} has nothing from fastft to revert (apply was not called on it)")
    if "packed_hook" in state:
        state["packed_hook"].remove()
        inner.set_attn_implementation(state["attention"])
    if "experts" in state and state["experts"] is not None:
        inner.set_experts_implementation(state["experts"])
    liger.revert(state)
    if "expert_parallel" in state:
        _gather_experts(state["expert_parallel"])
    if "checkpointing" in state:
        del inner.__dict__["gradient_checkpointing_enable"]
        flags, had_input_grads = state["checkpointing"]
        for module, enabled, func in flags:
            module.gradient_checkpointing = enabled
            if func is None:
                module.__dict__.pop("_gradient_checkpointing_func", None)
            else:
                module._gradient_checkpointing_func = func
        if not had_input_grads:
            inner.disable_input_require_grads()
    if ft_peft.has_lora(model):
        ft_peft.revert_lora(model)
    return model


_STATE = "_fastft_state"  # on the transformers model: what fastft changed and what it replaced


def hf_model(model):
    """The transformers model itself: ``model``, or the one inside a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _state(inner) -> dict:
    return inner.__dict__.setdefault(_STATE, {})
