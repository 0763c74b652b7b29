"""MoE experts blocks of transformers models through fastft: the experts implementation ``"fastft"``
(transformers' experts registry) runs ``fastft.experts.routed_experts``, or, on a block that
``use_expert_parallel`` sliced, ``fastft.moe_expert_parallel`` with this rank's experts. LoRA adapters on
the experts' weights come in through the keyword ``EXPERT_LORA_KWARG`` (``fastft.integrations.peft`` passes
PEFT ``target_parameters`` adapters there) and run as low-rank grouped GEMMs, never as ``W + B A``."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys

import torch

from ... import experts as experts_op
from ...expert_parallel import moe_expert_parallel
from ...swiglu import swiglu
from .. import liger
from ..models import has_experts, model_state, transformers_model
from . import lifecycle
from .mlps import activation as activation_name

EXPERTS_IMPLEMENTATION = "fastft"
EXPERT_SHARD = "fastft_expert_shard"  # in an experts block's __dict__ under use_expert_parallel
EXPERT_LORA_KWARG = "fastft_expert_lora"  # experts_forward's keyword: {weight name: fastft.experts.ExpertLoRA}


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


def lora_weights(block) -> tuple[str, str]:
    """The names of an experts block's up (or gate-up) and down weights: those ``experts_forward`` adapts."""
    return ("gate_up_proj" if block.has_gate else "up_proj"), "down_proj"


def gate_activation(block):
    """The function between an experts block's up (gate-up) and down projections: ``fastft.swiglu`` where the
    block's gate is one it computes (transformers' default gate over SiLU, or over GELU's tanh form: Gemma 4's
    experts; gpt-oss's clamped, interleaved gate with its alpha and limit), else the block's own ``_apply_gate``
    (``act_fn`` without a gate)."""
    if not block.has_gate:
        return block.act_fn
    if "_apply_gate" in block.__dict__:  # set on this block alone: its own
        return block._apply_gate
    gate = type(block)._apply_gate
    moe = sys.modules.get("transformers.integrations.moe")
    if gate is getattr(moe, "_default_apply_gate", None):
        name = activation_name(getattr(block, "act_fn", None))
        if name == "silu":
            return swiglu
        if name == "gelu_tanh":
            return functools.partial(swiglu, activation=name)
    gpt_oss = sys.modules.get("transformers.models.gpt_oss.modeling_gpt_oss")
    experts = getattr(gpt_oss, "GptOssExperts", None)
    if experts is not None and gate is experts.__dict__.get("_apply_gate"):
        alpha, limit = getattr(block, "alpha", None), getattr(block, "limit", None)
        if all(isinstance(v, (int, float)) and math.isfinite(v) for v in (alpha, limit)) and limit > 0:
            return functools.partial(swiglu, interleaved=True, alpha=alpha, limit=limit, up_shift=1.0)
    return block._apply_gate


def experts_forward(
    self,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    fastft_expert_lora: dict | None = None,
) -> torch.Tensor:
    """A transformers experts block's forward through ``fastft.experts.routed_experts`` (its activation as
    ``gate_activation`` gives it, its biases), or, after ``use_expert_parallel``, through
    ``fastft.moe_expert_parallel`` with this rank's experts. ``fastft_expert_lora`` (``EXPERT_LORA_KWARG``):
    None, or ``{name: ExpertLoRA}`` for the weights named by ``lora_weights``, added to them as low-rank
    products (``ValueError`` for another name, or with expert parallelism)."""
    shard = self.__dict__.get(EXPERT_SHARD)
    up_name, down_name = lora_weights(self)
    lora = fastft_expert_lora or {}
    if set(lora) - {up_name, down_name}:
        raise ValueError(
            f"fastft_expert_lora takes adapters on {up_name} and {down_name} only, got {sorted(lora)} on "
            f"{type(self).__name__}"
        )
    if lora and shard is not None:
        raise ValueError(
            "expert parallelism does not take LoRA on the experts yet (PEFT target_parameters): put LoRA on the "
            "other layers only"
        )
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
        experts_op.routed_experts,
        up=self.gate_up_proj if self.has_gate else self.up_proj,
        down=self.down_proj,
        transposed=self.is_transposed,
        activation=gate_activation(self),
        up_bias=(self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None,
        down_bias=self.down_proj_bias if self.has_bias else None,
        up_lora=lora.get(up_name),
        down_lora=lora.get(down_name),
    )
    if shard is None or shard.world == 1:  # a group of one rank holds every expert: nothing to send
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
    """Route every experts block of a transformers model (or a PEFT model around one) through fastft (see
    ``experts_forward``); returns the model. Liger-Kernel's fused MoE in their place (``swiglu=True``) is
    replaced by fastft's path, with a warning, whether Liger came before or after
    (``fastft.integrations.liger``). ``revert`` gives back the model's experts implementation."""
    inner = transformers_model(model)
    if not has_experts(model):
        raise ValueError(
            f"{type(model).__name__} has no transformers experts blocks (use_experts_implementation) to route"
        )
    state = model_state(inner)
    before = inner.config._experts_implementation
    configs = lifecycle.snapshot(inner, "_experts_implementation")
    register()
    inner.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    if "experts" not in state.records:
        state.add("experts", before, functools.partial(_restore, inner, before))
    lifecycle.own(inner, "_experts_implementation", configs)
    lifecycle.watch(inner)
    liger.keep_fastft_experts(model)
    return model


def _restore(inner, implementation) -> None:
    if implementation is not None:
        inner.set_experts_implementation(implementation)
