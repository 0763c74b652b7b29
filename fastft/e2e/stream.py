"""A seeded stream of fresh packed batches: what a fine-tuning run feeds its model, one new batch a step.

    for batch in packed_stream("padding-free", budget=16384, seed=0):
        loss = model(**batch.inputs()).loss

Each step draws new documents (SFT-like lengths, ``fastft.e2e.models.sft_lengths``) and new token ids,
and packs them into one row the two ways users pack:

- ``fixed``: the row holds exactly ``budget`` tokens, the last document cut to fit (packing with
  truncation: every batch has the same shape);
- ``padding-free``: whole documents in the order drawn, until the next one does not fit (TRL's
  ``padding_free``, ``DataCollatorWithFlattening``): the token count changes every step, no padding.

Step ``i`` of both kinds draws the same documents, so the two streams of one seed differ only in packing.
Labels are what a flattening collator writes: the token ids with -100 at each document's first token (the
model shifts labels by one, so no document is trained to predict the next one's first token).

``padded(batch, budget)`` gives the same documents as a padding collator does, for models whose packed rows
stock transformers gets wrong: one document per row, right-padded to the longest of its micro-batch, in
micro-batches of at most ``budget`` tokens padding included (gradient accumulation over them is one step).

The main job's streams (``model_stream``): each model's rows of ``fastft.e2e.models.budget`` tokens at most;
``step_inputs`` gives what a step feeds the model, packed or padded.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

from .models import MODEL_CONFIGS, budget, sft_lengths

KINDS = ("fixed", "padding-free")
STREAM_CHOICES = (*KINDS, "both")  # --stream
DEFAULT_STREAMS = ("padding-free",)
IGNORE = -100  # the label cross entropy skips


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed row of documents."""

    input_ids: torch.Tensor  # [1, num_tokens] int64 token ids
    position_ids: torch.Tensor  # [1, num_tokens] int64: 0, 1, ... restarting at each document
    labels: torch.Tensor  # [1, num_tokens] int64: input_ids with IGNORE at each document's first token
    seq_lengths: tuple[int, ...]  # document lengths (host ints, each > 0), summing to num_tokens
    num_tokens: int  # tokens in the row, all real (no padding)

    def inputs(self, host_lengths: bool = False) -> dict:
        """The keyword arguments of a transformers causal LM's forward. ``host_lengths``: also the document
        boundaries as a flattening collator's flash keyword arguments, ``cu_seq_lens_q``/``_k`` kept on the
        host (int32) with ``max_length_q``/``_k`` (ints), which fastft reads without a host sync."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "labels": self.labels}
        if host_lengths:
            cu = torch.tensor([0, *itertools.accumulate(self.seq_lengths)], dtype=torch.int32)
            longest = max(self.seq_lengths)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        return inputs

    def to(self, device) -> PackedBatch:
        """The same batch with its tensors on ``device``. To a GPU the host tensors go through pinned memory
        without blocking, as a ``DataLoader(pin_memory=True)`` feeds a training loop: no host sync."""
        device = torch.device(device)
        cuda = device.type == "cuda"

        def move(t):
            return t.pin_memory().to(device, non_blocking=True) if cuda and t.device.type == "cpu" else t.to(device)

        return dataclasses.replace(self, **{f: move(getattr(self, f)) for f in ("input_ids", "position_ids", "labels")})


@dataclasses.dataclass(frozen=True)
class PaddedBatch:
    """Documents one per row, right-padded to the longest: one micro-batch of ``padded``."""

    input_ids: torch.Tensor  # [rows, longest] int64 token ids, PAD_ID after each document
    attention_mask: torch.Tensor  # [rows, longest] int64: 1 on the document's tokens, 0 on padding
    labels: torch.Tensor  # [rows, longest] int64: the packed row's labels of each document, IGNORE on padding
    seq_lengths: tuple[int, ...]  # the rows' document lengths (host ints)
    targets: int  # tokens the loss predicts: sum(n - 1) (a row's first token is never a target)

    def inputs(self) -> dict:
        """The keyword arguments of a transformers causal LM's forward."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "labels": self.labels}


PAD_ID = 0  # what padding holds: masked out of attention and of the loss, its value does not matter


def padded(batch: PackedBatch, budget: int) -> list[PaddedBatch]:
    """The documents of ``batch`` one per row, right-padded, in micro-batches whose rows x longest row is at
    most ``budget`` (a document longer than that alone), in the order packed: no sorting by length, so
    the padding is what a padding collator over a shuffled set pays."""
    groups, rows = [], []
    for n in batch.seq_lengths:
        if rows and (len(rows) + 1) * max(*rows, n) > budget:
            groups.append(rows)
            rows = []
        rows.append(n)
    groups.append(rows)
    out, start = [], 0
    for rows in groups:
        width, parts = max(rows), {"input_ids": [], "attention_mask": [], "labels": []}
        for n in rows:
            pad = width - n
            cut = slice(start, start + n)
            parts["input_ids"].append(F.pad(batch.input_ids[0, cut], (0, pad), value=PAD_ID))
            parts["labels"].append(F.pad(batch.labels[0, cut], (0, pad), value=IGNORE))
            parts["attention_mask"].append(F.pad(torch.ones_like(batch.input_ids[0, cut]), (0, pad)))
            start += n
        fields = {k: torch.stack(v) for k, v in parts.items()}
        out.append(PaddedBatch(**fields, seq_lengths=tuple(rows), targets=sum(n - 1 for n in rows)))
    return out


def pack(kind: str, documents: list[int], budget: int) -> list[int]:
    """The lengths of the documents (drawn in this order) that one row of ``budget`` tokens holds, packed as
    ``kind`` (see the module docstring)."""
    if kind == "fixed":
        lengths = []
        for n in documents:
            lengths.append(min(n, budget - sum(lengths)))
            if sum(lengths) == budget:
                return lengths
        raise ValueError(f"documents of {sum(documents)} tokens do not fill a fixed row of {budget}")
    if kind == "padding-free":
        ends = itertools.accumulate(documents)
        return documents[: sum(1 for end in ends if end <= budget)]
    raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")


def packed_batch(lengths, vocab: int, generator: torch.Generator) -> PackedBatch:
    """A row of documents of ``lengths`` with token ids below ``vocab`` drawn from ``generator``."""
    lengths = tuple(int(n) for n in lengths)
    num_tokens = sum(lengths)
    ids = torch.randint(0, vocab, (1, num_tokens), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.masked_fill(positions == 0, IGNORE)
    return PackedBatch(ids, positions, labels, lengths, num_tokens)


def regroup(rows, groups) -> list[PackedBatch]:
    """The documents of ``rows`` (``PackedBatch``es; documents numbered in order, row by row) packed again, one
    row per group of document numbers (in the group's order): how a balanced plan
    (``fastft.balance_documents``) turns a global batch's rows into each rank's row. ``ValueError`` for an
    empty group or a number out of range."""
    documents, count = [], 0
    for row in rows:
        for n in row.seq_lengths:
            cut = slice(count, count + n)
            documents.append((row, cut, n))
            count += n
        count = 0
    out = []
    for g, group in enumerate(groups):
        if not len(group):
            raise ValueError(f"groups[{g}] is empty: a packed row holds at least one document")
        if any(not 0 <= i < len(documents) for i in group):
            raise ValueError(f"groups[{g}] has document numbers outside [0, {len(documents)})")
        parts = [documents[i] for i in group]
        fields = {
            f: torch.cat([getattr(r, f)[:, cut] for r, cut, _ in parts], 1)
            for f in ("input_ids", "position_ids", "labels")
        }
        lengths = tuple(n for _, _, n in parts)
        out.append(PackedBatch(**fields, seq_lengths=lengths, num_tokens=sum(lengths)))
    return out


def packed_stream(
    kind: str,
    budget: int,
    seed: int = 0,
    *,
    median: int = 380,
    max_len: int | None = None,
    vocab: int = 128000,
    device=None,
):
    """Endless iterator of ``PackedBatch`` rows of at most ``budget`` tokens, packed as ``kind``, the same for
    a seed: document lengths log-normal around ``median``, each at most ``max_len`` (default
    ``min(4096, budget // 2)``, so a padding-free row always holds several documents)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    for name, value in (("budget", budget), ("median", median), ("vocab", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    max_len = min(4096, budget // 2) if max_len is None else max_len
    if not isinstance(max_len, int) or isinstance(max_len, bool) or not 16 <= max_len <= budget:
        raise ValueError(f"max_len must be an int in [16, budget={budget}], got {max_len!r}")
    return _batches(kind, budget, seed, median, max_len, vocab, device)


def _batches(kind, budget, seed, median, max_len, vocab, device):
    steps = torch.Generator().manual_seed(seed)
    while True:
        step_seed = int(torch.randint(2**62, (), generator=steps))
        # past the budget by one longest document: the padding-free row sees the document that does not fit
        documents = sft_lengths(budget + max_len, seed=step_seed, median=median, max_len=max_len)
        batch = packed_batch(pack(kind, documents, budget), vocab, torch.Generator().manual_seed(step_seed + 1))
        yield batch if device is None else batch.to(device)


def streams_of(choice: str | None) -> tuple[str, ...]:
    """The stream kinds a ``--stream`` choice runs (None: the default, ``padding-free``)."""
    if choice is None:
        return DEFAULT_STREAMS
    if choice not in STREAM_CHOICES:
        raise ValueError(f"stream must be one of {', '.join(map(repr, STREAM_CHOICES))}, got {choice!r}")
    return KINDS if choice == "both" else (choice,)


def model_stream(name: str, kind: str, tiny: bool, device=None, seed: int = 0):
    """The endless stream of ``kind`` of the model ``name`` (``packed_stream``): rows of ``budget(name, tiny)``
    tokens at most, documents around 380 tokens (tiny: 40), token ids below 128,000 and the model's vocabulary."""
    vocab = 256 if tiny else min(128000, MODEL_CONFIGS[name][1]["vocab_size"])
    return packed_stream(kind, budget(name, tiny), seed, median=40 if tiny else 380, vocab=vocab, device=device)


def stream_batches(name: str, kind: str, tiny: bool, count: int, device=None, seed: int = 0) -> list[PackedBatch]:
    """The first ``count`` batches of ``model_stream``."""
    return list(itertools.islice(model_stream(name, kind, tiny, device, seed), count))


def step_inputs(batch: PackedBatch, padded_budget: int | None = None, host_lengths: bool = False):
    """What one step on ``batch`` feeds the model: the packed row's model inputs (a dict; ``host_lengths``: with
    the boundaries on the host, ``PackedBatch.inputs``), or with ``padded_budget`` its documents ``padded`` to
    micro-batches of that many tokens, as ``[(model inputs, loss weight), ...]``, each weight its share of the
    step's predicted tokens (host ints: no sync), so that the weighted losses sum to the packed loss."""
    if padded_budget is None:
        return batch.inputs(host_lengths)
    parts = padded(batch, padded_budget)
    total = sum(p.targets for p in parts)
    return [(p.inputs(), p.targets / total) for p in parts]


def micro_batches(step) -> list:
    """``[(model inputs, loss weight or None), ...]`` of a step as ``step_inputs`` gives it."""
    return [(step, None)] if isinstance(step, dict) else list(step)
