"""Triton kernels for fastft.rms_norm (spec: fastft/reference/rms_norm.py).

Tiles of whole rows (``BLOCK_H``, a power of two at least the width) by ``BLOCK_R`` rows. A row normalised in
groups of ``width`` channels (Nemotron-H's and Zamba2's gated norms) is ``groups`` such rows side by side: the
second axis of the grid names the group, whose channels (and weight) start at ``group * width``. The forward
reads each row once and writes the output and the row's fp32 ``r`` (``[rows, groups]``). The backward reads
``x``, the output's gradient and ``r`` once and writes ``x``'s gradient; where the weight's gradient is asked,
each program walks a run of one group's tiles (software-pipelined), summing it in fp32 registers, and writes
its share of a row of partial sums ``[programs, H]`` that the caller adds up (a fixed order: the same bits on
every run). With a gate z (``GATE`` 1: ``silu(z)`` scales the output, 2: the input; ``SIGMOID``: ``sigmoid(z)``
in its place), z is read with x and its gradient written with x's. Launch wrappers take explicit launch
parameters; choosing them is fastft.rms_norm's job. Row offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, launch, next_power_of_2


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_forward_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    rstd_ptr,
    rows,
    width,
    groups,
    stride_x,
    stride_z,
    stride_out,
    eps,
    offset,
    GATE: tl.constexpr,
    SIGMOID: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.program_id(1)
    c = tl.arange(0, BLOCK_H)
    x_ptr += group * width
    z_ptr += group * width
    w_ptr += group * width
    out_ptr += group * width
    mask = (r < rows)[:, None] & (c < width)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if GATE:
        z = tl.load(z_ptr + r[:, None] * stride_z + c[None, :], mask=mask, other=0.0).to(tl.float32)
        if SIGMOID:
            s = tl.sigmoid(z)
        else:
            s = z * tl.sigmoid(z)
        if GATE == 2:
            x = x * s
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / width + eps)
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32) + offset
    y = x * rstd[:, None] * w[None, :]
    if GATE == 1:
        y = y * s
    tl.store(out_ptr + r[:, None] * stride_out + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + r * groups + group, rstd, mask=r < rows)


@triton.jit(do_not_specialize=["rows", "tiles_per_program"])
def _rms_norm_backward_kernel(
    dy_ptr,
    x_ptr,
    z_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dz_ptr,
    dw_ptr,
    rows,
    width,
    groups,
    stride_dy,
    stride_x,
    stride_z,
    stride_dx,
    stride_dz,
    offset,
    tiles_per_program,
    DW: tl.constexpr,
    GATE: tl.constexpr,
    SIGMOID: tl.constexpr,
    STAGES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    group = tl.program_id(1)
    c = tl.arange(0, BLOCK_H)
    dy_ptr += group * width
    x_ptr += group * width
    z_ptr += group * width
    w_ptr += group * width
    dx_ptr += group * width
    dz_ptr += group * width
    w = tl.load(w_ptr + c, mask=c < width, other=0.0).to(tl.float32) + offset
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for i in tl.range(tiles_per_program, num_stages=STAGES):
        r = (pid * tiles_per_program + i).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (r < rows)[:, None] & (c < width)[None, :]
        x = tl.load(x_ptr + r[:, None] * stride_x + c[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r[:, None] * stride_dy + c[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r * groups + group, mask=r < rows, other=0.0)
        u = x
        e = dy  # the output's gradient before a gate after the norm
        if GATE:
            z = tl.load(z_ptr + r[:, None] * stride_z + c[None, :], mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            if SIGMOID:
                s = sig
                ds = sig * (1.0 - sig)
            else:
                s = z * sig
                ds = sig * (1.0 + z * (1.0 - sig))
            if GATE == 1:
                e = dy * s
            else:
                u = x * s
        n = u * rstd[:, None]
        g = e * w[None, :]
        m = tl.sum(g * n, axis=1) / width
        du = rstd[:, None] * (g - n * m[:, None])
        dx = du
        if GATE == 1:
            dz = dy * n * w[None, :] * ds
        if GATE == 2:
            dx = du * s
            dz = du * x * ds
        if GATE:
            tl.store(dz_ptr + r[:, None] * stride_dz + c[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + r[:, None] * stride_dx + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if DW:
            acc += tl.sum(e * n, axis=0)
    if DW:
        tl.store(dw_ptr + pid.to(tl.int64) * width * groups + group * width + c, acc, mask=c < width)


def _blocks(width: int, TILE: int) -> tuple[int, int]:
    block_h = next_power_of_2(width)
    return max(1, TILE // block_h), block_h


def _gate(gate: torch.Tensor | None, gate_first: bool) -> int:
    return 0 if gate is None else 2 if gate_first else 1


def rms_norm_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
    *,
    TILE: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output ``[R, H]`` (``x``'s dtype) and the fp32 ``r`` ``[R * G]`` of each row's each group of
    ``group_size`` channels (G = H / group_size; default: the whole row) of ``x`` ``[R, H]`` (unit column
    stride) and ``weight`` ``[H]`` (contiguous), gated by ``gate`` (x's shape, unit column stride, or None) as
    ``fastft.reference.rms_norm`` says; tiles of about ``TILE`` elements."""
    rows, full = x.shape
    width = group_size or full
    groups = full // width
    out = torch.empty((rows, full), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows * groups, dtype=torch.float32, device=x.device)
    block_r, block_h = _blocks(width, TILE)
    if rows:
        launch(
            _rms_norm_forward_kernel,
            (cdiv(rows, block_r), groups),
            x,
            x if gate is None else gate,
            weight,
            out,
            rstd,
            rows,
            width,
            groups,
            x.stride(0),
            0 if gate is None else gate.stride(0),
            out.stride(0),
            eps,
            offset,
            GATE=_gate(gate, gate_first),
            SIGMOID=gate is not None and gate_activation == "sigmoid",
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    return out, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float,
    grad_weight: bool,
    gate: torch.Tensor | None = None,
    gate_first: bool = False,
    gate_activation: str = "silu",
    group_size: int | None = None,
    *,
    programs: int,
    stages: int,
    TILE: int,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x``'s gradient (its dtype), with ``grad_weight`` ``weight``'s in fp32 (else an empty tensor), and the
    gate's (its dtype; None without one), from the output's ``dy`` ``[R, H]`` (unit column stride) and the
    forward's ``rstd``; with ``grad_weight`` at most ``programs`` programs, each summing its rows' share of
    ``weight``'s gradient (of one group), their loads ``stages - 1`` tiles ahead (without, a program a tile)."""
    rows, full = x.shape
    width = group_size or full
    groups = full // width
    dx = torch.empty((rows, full), dtype=x.dtype, device=x.device)
    dz = None if gate is None else torch.empty((rows, full), dtype=gate.dtype, device=x.device)
    block_r, block_h = _blocks(width, TILE)
    tiles = cdiv(rows, block_r)
    programs = max(1, min(programs // groups, tiles))
    per = cdiv(tiles, programs) if grad_weight else 1  # no sums to keep: a program a tile
    grid = cdiv(tiles, per) if rows else 0
    partial = torch.empty((grid, full) if grad_weight else (0,), dtype=torch.float32, device=x.device)
    if rows:
        launch(
            _rms_norm_backward_kernel,
            (grid, groups),
            dy,
            x,
            x if gate is None else gate,
            weight,
            rstd,
            dx,
            dx if dz is None else dz,
            partial,
            rows,
            width,
            groups,
            dy.stride(0),
            x.stride(0),
            0 if gate is None else gate.stride(0),
            dx.stride(0),
            0 if dz is None else dz.stride(0),
            offset,
            per,
            DW=grad_weight,
            GATE=_gate(gate, gate_first),
            SIGMOID=gate is not None and gate_activation == "sigmoid",
            STAGES=stages,
            BLOCK_R=block_r,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    if not grad_weight:
        return dx, partial, dz
    return dx, partial.sum(0) if rows else torch.zeros(full, dtype=torch.float32, device=x.device), dz
