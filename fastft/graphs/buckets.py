"""Few shapes from a stream of packed batches: each batch's token count rounded up a short ladder, the
padding tokens made documents of their own, so that CUDA graphs (``fastft.graphs``) see few signatures.

    pad = fastft.graphs.buckets.token_padding(15_000)   # TokenPadding(tokens=15000, padded=15360)
    ids = pad.pad(input_ids)                      # [B, 15360]: the padding tokens are id 0
    pos = pad.pad_positions(position_ids)         # the padding tokens: documents of at most 128 tokens
    ...                                           # the layers: no real token attends to a padding one
    hidden = pad.unpad(hidden)                    # [B, 15000, ...]: the real tokens only

The ladder holds ``per_octave`` values per power of two (``m * 2**k`` with ``per_octave <= m <
2 * per_octave``), so a stream whose rows hold from ``budget / 2`` to ``budget`` tokens uses at most
``per_octave + 1`` token counts, and padding adds less than ``1 / per_octave`` of the tokens (8 per octave:
under 12.5%). Counts below ``2 * per_octave`` are their own bucket.

Padding documents are at most ``PAD_DOCUMENT`` tokens (one flash tile): their attention costs little and
they never raise a batch's longest sequence past ``PAD_DOCUMENT``.
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import int_arg

PER_OCTAVE = 8  # ladder values per power of two
PAD_DOCUMENT = 128  # the longest padding document

__all__ = ["PAD_DOCUMENT", "PER_OCTAVE", "TokenPadding", "token_bucket", "token_padding"]


def _per_octave(per_octave) -> int:
    int_arg("per_octave", per_octave, minimum=1)
    if per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    return int(per_octave)


def token_bucket(tokens: int, per_octave: int = PER_OCTAVE) -> int:
    """``tokens`` rounded up to the ladder (see the module docstring): the smallest ``m * 2**k >= tokens``
    with ``m < 2 * per_octave``."""
    tokens = int_arg("tokens", tokens, minimum=0)
    step = 1 << max(tokens.bit_length() - _per_octave(per_octave).bit_length(), 0)
    return -(-tokens // step) * step


@dataclasses.dataclass(frozen=True)
class TokenPadding:
    """How one batch's rows are padded: ``tokens`` real tokens per row, then ``padded - tokens`` padding
    tokens at the end of every row."""

    tokens: int  # real tokens per row
    padded: int  # tokens per row after padding

    @property
    def extra(self) -> int:
        """Padding tokens per row."""
        return self.padded - self.tokens

    def _check(self, name: str, t, dim: int) -> int:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not -t.dim() <= dim < t.dim():
            raise ValueError(f"dim={dim} is out of range for {name} of shape {tuple(t.shape)}")
        return dim % t.dim()

    def pad(self, t: torch.Tensor, dim: int = 1, value=0) -> torch.Tensor:
        """``t`` (``tokens`` long along ``dim``) with ``extra`` entries of ``value`` appended along ``dim``."""
        dim = self._check("t", t, dim)
        if t.shape[dim] != self.tokens:
            raise ValueError(f"t has {t.shape[dim]} entries along dim {dim}, expected {self.tokens}")
        if not self.extra:
            return t
        shape = list(t.shape)
        shape[dim] = self.extra
        return torch.cat([t, t.new_full(shape, value)], dim)

    def pad_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Position ids (``[T]`` or ``[B, T]``) padded along the last dimension with ``0, 1, ...``
        restarting every ``PAD_DOCUMENT`` tokens: a document starts wherever a position id is not the
        previous one plus 1 (``fastft.packed_seq_info``), so the padding forms documents of its own."""
        self._check("position_ids", position_ids, -1)
        if position_ids.dim() not in (1, 2) or position_ids.shape[-1] != self.tokens:
            raise ValueError(
                f"position_ids must be [T] or [B, T] with T={self.tokens}, got shape {tuple(position_ids.shape)}"
            )
        if not self.extra:
            return position_ids
        tail = torch.arange(self.extra, device=position_ids.device, dtype=position_ids.dtype) % PAD_DOCUMENT
        return torch.cat([position_ids, tail.expand(*position_ids.shape[:-1], self.extra)], -1)

    def pad_cu_seqlens(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """A single row's ``cu_seqlens`` (1-D, from 0 to at most ``tokens``) with the padding's documents
        appended: boundaries at ``tokens``, then every ``PAD_DOCUMENT`` tokens, then ``padded`` (a repeated
        boundary is an empty sequence, which ``packed_seq_info`` drops)."""
        self._check("cu_seqlens", cu_seqlens, 0)
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        if not self.extra:
            return cu_seqlens
        ends = list(range(self.tokens, self.padded, PAD_DOCUMENT)) + [self.padded]
        return torch.cat([cu_seqlens, torch.tensor(ends, dtype=cu_seqlens.dtype).to(cu_seqlens.device)])

    def unpad(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The real tokens of ``t`` (``padded`` long along ``dim``): a view of the first ``tokens``."""
        dim = self._check("t", t, dim)
        if t.shape[dim] != self.padded:
            raise ValueError(f"t has {t.shape[dim]} entries along dim {dim}, expected {self.padded}")
        return t.narrow(dim, 0, self.tokens)


def token_padding(tokens: int, per_octave: int = PER_OCTAVE) -> TokenPadding:
    """The ``TokenPadding`` of rows of ``tokens`` tokens: padded to ``token_bucket(tokens, per_octave)``."""
    return TokenPadding(int_arg("tokens", tokens, minimum=0), token_bucket(tokens, per_octave))
