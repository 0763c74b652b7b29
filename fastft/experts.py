"""Routed MoE experts: every (token, expert) pair through its expert's up (or gate-up) projection, activation
and down projection, combined by the router's weights (``routed_experts``), on fastft's routing; with LoRA
adapters on either projection (``ExpertLoRA``, one pair per expert) without forming ``W + B A``.

    out = fastft.experts.routed_experts(hidden, topk_ids, topk_weights, up, down, transposed=False, activation=act)

Steps: ``moe_route`` (no host sync) -> ``moe_permute`` -> ``grouped_linear`` up (+ ``up_bias`` rows through
``moe_expert_rows``) -> ``activation`` -> ``grouped_linear`` down (+ ``down_bias`` rows) -> ``moe_unpermute``
weighted by the router (fp32 sum in ascending k). ``grouped_linear`` is ``torch._grouped_mm`` where it runs
(CUDA bf16, aligned sizes; no host sync), else one matmul per expert, which reads the offsets on the host.
A projection with an ``ExpertLoRA`` adds ``scaling * (x A_e^T) B_e^T`` to its rows: one more grouped GEMM over
the same rows and offsets (``u = x A_e^T``, ``[N, r]``), then ``grouped_lowrank_add`` adds ``u B_e^T`` to the
base GEMM's rows in one pass (a Triton kernel; no ``[N, out]`` product and no add of its own); backward the
same way (``dx = dy W_e + scaling (dy B_e) A_e`` in one low-rank add), the adapters' gradients as grouped
GEMMs over the rows. The adapters are cast to the rows' dtype (``r`` padded to a multiple of 8 on CUDA, with
zeros, for ``torch._grouped_mm``). Nothing of the weights' size is formed, in forward or backward: PEFT's
``target_parameters`` path forms ``W + scaling B A`` for every expert at every call.
The specification is ``fastft.reference.experts``. transformers' experts blocks call this through
``fastft.integrations.transformers`` (``use_moe``); nothing here imports transformers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import autotune, capabilities, dispatch
from ._checks import number_arg
from ._custom_op import custom_op
from .reference import experts as reference
from .routing import moe_expert_rows, moe_permute, moe_route, moe_unpermute

__all__ = ["ExpertLoRA", "grouped_linear", "grouped_lowrank_add", "routed_experts"]

OP_LOWRANK_ADD = dispatch.register("experts.grouped_lowrank_add")
# A pass over y: 64 x 128 tiles, 4 warps. The interpreter's 16 x 16 tiles (tl.dot's least) make small test
# inputs span several programs and experts.
autotune.register(
    OP_LOWRANK_ADD,
    autotune.Tunable({"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4}, interpreter={"BLOCK_M": 16, "BLOCK_N": 16}),
)


@dataclasses.dataclass(frozen=True)
class ExpertLoRA:
    """LoRA adapters on one projection of every expert (PEFT ``target_parameters``' pairs): expert ``e``'s
    rows ``x`` (``[n, in]``) get ``scaling * (x @ a[e].T) @ b[e].T`` added, whichever layout the base weight has.
    Checked by ``routed_experts``."""

    a: torch.Tensor  # [E, r, in]: expert e's A (PEFT's lora_A.weight [E*r, in] viewed per expert)
    b: torch.Tensor  # [E, out, r]: expert e's B (PEFT's lora_B.weight [out, r*E] holds expert e in columns e::E)
    scaling: float  # the factor on the low-rank product: lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _tensor(name: str, t, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")


def _weights(name: str, weight, transposed) -> tuple[int, int, int]:
    """(experts, in features, out features) of an ``[E, out, in]`` (``[E, in, out]`` if transposed) weight."""
    _tensor(name, weight, 3)
    if not weight.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {weight.dtype}")
    experts, a, b = weight.shape
    return (experts, a, b) if transposed else (experts, b, a)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    w = weight if transposed else weight.transpose(-2, -1)
    if capabilities.grouped_mm(x, weight):
        return torch._grouped_mm(x, w, offs=ends)
    starts = [0] + ends.tolist()
    if any(b < a for a, b in zip(starts, starts[1:])) or starts[-1] > x.shape[0]:
        raise ValueError(f"ends must be ascending row ends in [0, {x.shape[0]}] (x's rows), got {starts[1:]}")
    rows = [x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, starts[1:]))]
    return torch.cat(rows + [x.new_zeros(x.shape[0] - starts[-1], w.shape[-1])])  # padding rows: 0


@custom_op("fastft::grouped_lowrank_add")
def lowrank_add_op(
    y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, ends: torch.Tensor, scaling: float, backend: str
) -> torch.Tensor:
    """``grouped_lowrank_add`` on the backend named, no validation: ``y`` ``[N, out]`` and ``u`` ``[N, r]``
    with unit column stride, ``v`` ``[E, r, out]`` in ``u``'s dtype, ``ends`` ``[E]`` int32 contiguous."""
    if backend == "torch" or y.numel() == 0 or u.shape[1] == 0:
        with torch.no_grad():  # not differentiable on either backend
            return reference.grouped_lowrank_add(y, u, v, ends, scaling)
    from .kernels import experts as kernels

    return kernels.grouped_lowrank_add(y, u, v, ends, scaling, **autotune.params(OP_LOWRANK_ADD, y.device, y.numel()))


@lowrank_add_op.register_fake
def _(y, u, v, ends, scaling, backend):
    return y.new_empty(y.shape)


def _grouped_outer(m1: torch.Tensor, m2: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[E, P, Q]``: expert ``e``'s ``m1[rows].T @ m2[rows]`` (``m1`` ``[N, P]``, ``m2`` ``[N, Q]``), a weight's
    gradient over each expert's rows; rows from ``ends[-1]`` on take no part."""
    if m1.is_cuda and m1.dtype == m2.dtype == torch.bfloat16 and m1.shape[1] % 8 == 0 and m2.shape[1] % 8 == 0:
        return torch._grouped_mm(m1.contiguous().t(), m2.contiguous(), offs=ends)
    starts = [0] + ends.tolist()
    return torch.stack([m1[a:b].T @ m2[a:b] for a, b in zip(starts, starts[1:])])


class _AdaptedLinear(torch.autograd.Function):
    """``_grouped_linear`` plus a LoRA pair's low-rank product over the same rows, its backward written out:
    one low-rank add each way instead of a product and an add (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, ends, transposed, scaling, backend):
        a = lora_a.to(x.dtype)
        b = lora_b.to(x.dtype)
        pad = -a.shape[1] % 8 if x.is_cuda else 0  # torch._grouped_mm takes 16-byte aligned rows only
        if pad:
            a, b = F.pad(a, (0, 0, 0, pad)), F.pad(b, (0, pad))
        a, b = a.contiguous(), b.contiguous()  # [E, r, in], [E, out, r]
        xa = _grouped_linear(x, a, ends, False)  # [N, r]
        y = lowrank_add_op(_grouped_linear(x, weight, ends, transposed), xa, b.transpose(1, 2), ends, scaling, backend)
        ctx.save_for_backward(x, weight, a, b, xa, ends)
        ctx.args = (transposed, scaling, backend, lora_a.shape[1], lora_a.dtype, lora_b.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, a, b, xa, ends = ctx.saved_tensors
        transposed, scaling, backend, rank, a_dtype, b_dtype = ctx.args
        dy = dy.contiguous()
        dyb = _grouped_linear(dy, b, ends, True)  # [N, r]: dy_e @ B_e
        dx = dw = da = db = None
        if ctx.needs_input_grad[0]:
            dx = lowrank_add_op(_grouped_linear(dy, weight, ends, not transposed), dyb, a, ends, scaling, backend)
        if ctx.needs_input_grad[1]:
            dw = _grouped_outer(x, dy, ends) if transposed else _grouped_outer(dy, x, ends)
        if ctx.needs_input_grad[2]:
            da = _grouped_outer(dyb, x, ends)[:, :rank].mul_(scaling).to(a_dtype)
        if ctx.needs_input_grad[3]:
            db = _grouped_outer(dy, xa, ends)[:, :, :rank].mul_(scaling).to(b_dtype)
        return dx, dw, da, db, None, None, None, None


def _adapted_linear(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool, lora: ExpertLoRA | None
) -> torch.Tensor:
    """``_grouped_linear`` plus, with ``lora``, its low-rank product over the same rows."""
    if lora is None:
        return _grouped_linear(x, weight, ends, transposed)
    backend = dispatch.backend_for(OP_LOWRANK_ADD, x.device)
    return _AdaptedLinear.apply(x, weight, lora.a, lora.b, ends, transposed, float(lora.scaling), backend)


def _check_lora(name: str, lora, experts: int, in_features: int, out_features: int, device: torch.device) -> None:
    if not isinstance(lora, ExpertLoRA):
        raise TypeError(f"{name} must be a fastft.experts.ExpertLoRA or None, got {type(lora).__name__}")
    for part, t in (("a", lora.a), ("b", lora.b)):
        _tensor(f"{name}.{part}", t, 3)
        if not t.is_floating_point():
            raise TypeError(f"{name}.{part} must be floating point, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name}.{part} is on {t.device}, hidden_states on {device}: all must be on one device")
    rank = lora.a.shape[1]
    if rank < 1 or tuple(lora.a.shape) != (experts, rank, in_features):
        raise ValueError(f"{name}.a must be [E, r, in]=({experts}, r >= 1, {in_features}), got {tuple(lora.a.shape)}")
    if tuple(lora.b.shape) != (experts, out_features, rank):
        raise ValueError(f"{name}.b must be [E, out, r]=({experts}, {out_features}, {rank}), got {tuple(lora.b.shape)}")
    number_arg(f"{name}.scaling", lora.scaling)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``[N, out]``: rows ``ends[e-1]:ends[e]`` of ``x`` ``[N, in]`` times expert ``e``'s matrix, ``weight[e]``
    (``[in, out]``) when ``transposed``, else ``weight[e].T`` (``weight`` is ``[E, out, in]``); rows from
    ``ends[-1]`` on are zero. ``ends``: ``[E]`` int32 ascending row ends, at most ``N``
    (``MoERouting.offsets[1:]``): checked (``ValueError``) where the product runs one matmul per expert, which
    reads them on the host; ``torch._grouped_mm`` (CUDA bf16) takes them unread, so there they are the
    caller's promise."""
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed must be True or False, got {transposed!r}")
    _tensor("x", x, 2)
    experts, in_features, _ = _weights("weight", weight, transposed)
    _tensor("ends", ends, 1)
    if x.shape[1] != in_features:
        raise ValueError(f"x must be [N, {in_features}] (weight's in features), got {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x must have weight's dtype {weight.dtype}, got {x.dtype}")
    if ends.shape[0] != experts or ends.dtype != torch.int32:
        raise ValueError(f"ends must be [E={experts}] int32, got {tuple(ends.shape)} {ends.dtype}")
    return _grouped_linear(x, weight, ends, transposed)


def grouped_lowrank_add(
    y: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    ends: torch.Tensor,
    scaling: float = 1.0,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``[N, out]`` in ``y``'s dtype: ``y[i] + scaling * u[i] @ v[e]`` for each row ``i`` of expert ``e``
    (``ends[e-1] <= i < ends[e]``), computed in fp32; rows from ``ends[-1]`` on are ``y``'s. One pass over
    ``y`` (a LoRA adapter's second product added to a grouped GEMM's rows; ``v = B_e^T``).

    ``y``: ``[N, out]`` floating; ``u``: ``[N, r]`` floating; ``v``: ``[E, r, out]`` in ``u``'s dtype, any
    strides; ``ends``: ``[E]`` int32 ascending row ends, at most ``N`` (``MoERouting.offsets[1:]``); all on
    one device. Not differentiable: the result carries no gradient (``routed_experts`` writes its backward
    out). ``backend``: ``auto``, ``triton`` or ``torch``. ``TypeError``/``ValueError`` naming the argument
    for anything else; ``ends`` is not read on the host, so its order and bound are the caller's promise (a
    row past ``ends[-1]`` is left as ``y``'s)."""
    for name, t, dim in (("y", y, 2), ("u", u, 2), ("v", v, 3), ("ends", ends, 1)):
        _tensor(name, t, dim)
        if t.device != y.device:
            raise ValueError(f"{name} is on {t.device}, y on {y.device}: all must be on one device")
    for name, t in (("y", y), ("u", u), ("v", v)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if v.dtype != u.dtype:
        raise TypeError(f"v must have u's dtype {u.dtype}, got {v.dtype}")
    rows, cols = y.shape
    if u.shape[0] != rows:
        raise ValueError(f"u must be [N={rows}, r], got {tuple(u.shape)}")
    if tuple(v.shape[1:]) != (u.shape[1], cols):
        raise ValueError(f"v must be [E, r, out]=(E, {u.shape[1]}, {cols}), got {tuple(v.shape)}")
    if ends.shape[0] != v.shape[0] or ends.dtype != torch.int32:
        raise ValueError(f"ends must be [E={v.shape[0]}] int32, got {tuple(ends.shape)} {ends.dtype}")
    scaling = number_arg("scaling", scaling)
    chosen = dispatch.backend_for(OP_LOWRANK_ADD, y.device, backend)
    y = y if y.stride(-1) == 1 or cols <= 1 else y.contiguous()
    u = u if u.stride(-1) == 1 or u.shape[1] <= 1 else u.contiguous()
    return lowrank_add_op(y, u, v, ends.contiguous(), float(scaling), chosen)


def routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor | None,
    up: torch.Tensor,
    down: torch.Tensor,
    *,
    transposed: bool,
    activation: Callable[[torch.Tensor], torch.Tensor],
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    up_lora: ExpertLoRA | None = None,
    down_lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """``[T, H_out]`` in ``hidden_states``' dtype: ``sum_k top_k_weights[t, k] * expert_e(hidden_states[t])``
    with ``e = top_k_index[t, k]`` and ``expert_e(x) = activation(x @ up_e + up_bias[e]) @ down_e +
    down_bias[e]``, summed in fp32 in ascending k (see the module docstring). With ``up_lora`` (``down_lora``),
    ``up_e`` (``down_e``) acts as ``up_e + scaling * (b[e] @ a[e]).T`` in the ``[in, out]`` orientation, computed
    as low-rank products over the routed rows (``W + B A`` is never formed).

    ``hidden_states``: ``[T, H]`` floating; ``top_k_index``: ``[T, K]`` int32/int64, ids outside ``[0, E)``
    (expert-parallel sentinels) contribute nothing; ``top_k_weights``: ``[T, K]`` floating or None (all
    ones); ``up``: ``[E, I_up, H]`` and ``down``: ``[E, H_out, I]`` (``[E, H, I_up]`` and ``[E, I, H_out]`` if
    ``transposed``); ``activation`` maps ``[N, I_up]`` to ``[N, I]`` (e.g. a gate over the halves of a fused
    gate-up projection); ``up_bias`` ``[E, I_up]`` and ``down_bias`` ``[E, H_out]`` or None; ``up_lora``
    (``a`` ``[E, r, H]``, ``b`` ``[E, I_up, r]``) and ``down_lora`` (``a`` ``[E, r', I]``, ``b``
    ``[E, H_out, r']``) ``ExpertLoRA`` or None, on ``hidden_states``' device; ``up``, ``down``, the biases and
    ``activation``'s output in ``hidden_states``' dtype (outside autocast). Differentiable in every tensor
    (the weights frozen or not). ``TypeError``/``ValueError`` naming the argument for anything else."""
    if not isinstance(transposed, bool):
        raise TypeError(f"transposed must be True or False, got {transposed!r}")
    if not callable(activation):
        raise TypeError(f"activation must be callable, got {type(activation).__name__}")
    _tensor("hidden_states", hidden_states, 2)
    _tensor("top_k_index", top_k_index, 2)
    if not hidden_states.is_floating_point():
        raise TypeError(f"hidden_states must be floating point, got {hidden_states.dtype}")
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"top_k_index must be int32 or int64, got {top_k_index.dtype}")
    tokens = hidden_states.shape[0]
    if top_k_index.shape[0] != tokens:
        raise ValueError(f"top_k_index must be [T={tokens}, K], got {tuple(top_k_index.shape)}")
    if top_k_weights is not None:
        _tensor("top_k_weights", top_k_weights, 2)
        if top_k_weights.shape != top_k_index.shape:
            raise ValueError(f"top_k_weights must be [T, K]={tuple(top_k_index.shape)}, got {_shape(top_k_weights)}")
        if not top_k_weights.is_floating_point():
            raise TypeError(f"top_k_weights must be floating point, got {top_k_weights.dtype}")
    experts, up_in, up_out = _weights("up", up, transposed)
    down_experts, down_in, down_out = _weights("down", down, transposed)
    if experts < 1:
        raise ValueError(f"up and down must hold at least one expert, got up {tuple(up.shape)}")
    # Outside autocast every product runs in hidden_states' dtype (under it, the matmuls cast).
    autocast = torch.is_autocast_enabled(hidden_states.device.type)
    for name, t in (("up", up), ("down", down), ("up_bias", up_bias), ("down_bias", down_bias)):
        if isinstance(t, torch.Tensor) and t.dtype != hidden_states.dtype and not autocast:
            raise TypeError(f"{name} must have hidden_states' dtype {hidden_states.dtype}, got {t.dtype}")
    if up_in != hidden_states.shape[1]:
        raise ValueError(f"up's in features ({up_in}) must be hidden_states' width {hidden_states.shape[1]}")
    if down_experts != experts:
        raise ValueError(f"up and down must have the same number of experts, got {experts} and {down_experts}")
    for name, bias, width in (("up_bias", up_bias, up_out), ("down_bias", down_bias, down_out)):
        if bias is not None:
            _tensor(name, bias, 2)
            if tuple(bias.shape) != (experts, width):
                raise ValueError(f"{name} must be [E, out]=({experts}, {width}), got {tuple(bias.shape)}")
    if up_lora is not None:
        _check_lora("up_lora", up_lora, experts, up_in, up_out, hidden_states.device)
    if down_lora is not None:
        _check_lora("down_lora", down_lora, experts, down_in, down_out, hidden_states.device)

    routing = moe_route(top_k_index, experts)
    ends = routing.offsets[1:]
    h = _adapted_linear(moe_permute(hidden_states, routing), up, ends, transposed, up_lora)
    if up_bias is not None:
        h = h + moe_expert_rows(up_bias, routing)
    h = activation(h)
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != down_in:
        raise ValueError(f"activation must return [N, {down_in}] (down's in features), got {_shape(h)}")
    if h.dtype != down.dtype and not autocast:
        raise TypeError(f"activation must return down's dtype {down.dtype}, got {h.dtype}")
    out = _adapted_linear(h, down, ends, transposed, down_lora)
    if down_bias is not None:
        out = out + moe_expert_rows(down_bias, routing)
    return moe_unpermute(out, routing, top_k_weights).to(hidden_states.dtype)
