"""Token-balanced data-parallel batches for a plain loop, ``transformers.Trainer`` and TRL: a batch sampler over
a dataset of documents whose every optimizer step is split by ``fastft.balance_documents``.

    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithFlattening
    from fastft.integrations.balance import BalancedBatchSampler

    # a plain loop, on each rank: its own micro-batches, one packed row each
    sampler = BalancedBatchSampler(lengths, tokens_per_step=8 * 16384, world_size=world, accumulation=4, rank=rank)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=DataCollatorWithFlattening())

    # Trainer / SFTTrainer: every micro-batch in order (rank=None); accelerate hands process r its own
    class BalancedTrainer(transformers.Trainer):   # or trl.SFTTrainer
        def get_train_dataloader(self):
            sampler = BalancedBatchSampler(lengths, tokens_per_step=..., world_size=self.args.world_size,
                                           accumulation=self.args.gradient_accumulation_steps, seed=self.args.seed)
            loader = DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

Each epoch shuffles the documents (``seed``, epoch), cuts the shuffled order into global batches (the next
documents while they fit ``tokens_per_step``, and at least one per micro-batch: ``world_size * accumulation``)
and splits each global batch with ``balance_documents``. Without ``rank`` it yields a step's micro-batches
slot by slot, rank by rank within a slot: accelerate's ``prepare`` (``BatchSamplerShard``) gives process ``r``
every ``world_size``-th batch, which is rank ``r``'s share. Documents of 0 tokens are skipped; the documents
left after the last whole global batch (fewer than one per micro-batch) wait for the next epoch's shuffle.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .._checks import bool_arg, int_arg
from ..balance import DEFAULT_ATTENTION_TOKENS, BalancedPlan, balance_documents, host_lengths

__all__ = ["BalancedBatchSampler"]


class BalancedBatchSampler(torch.utils.data.Sampler):
    """Micro-batches of dataset indices, each optimizer step's documents balanced over ranks and accumulation
    slots (see the module docstring). ``lengths[i]``: the token count of dataset item ``i``. ``rank``: None
    (every micro-batch, for accelerate / Trainer / TRL) or this process's rank (its micro-batches only).
    ``seed`` and ``epoch`` fix the shuffle (``shuffle=False``: dataset order); each full iteration moves to the
    next epoch, ``set_epoch`` sets it. ``attention_tokens``: see ``fastft.balance``.

    ``TypeError``/``ValueError`` naming the argument, as ``balance_documents`` for ``lengths``, and for a
    ``tokens_per_step`` < 1, ``world_size`` or ``accumulation`` < 1, a ``rank`` outside ``[0, world_size)``,
    a non-bool ``shuffle``, a negative ``seed`` or ``epoch``."""

    def __init__(
        self,
        lengths,
        *,
        tokens_per_step: int,
        world_size: int,
        accumulation: int = 1,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        epoch: int = 0,
        attention_tokens: int = DEFAULT_ATTENTION_TOKENS,
    ) -> None:
        self.lengths = host_lengths(lengths)
        self.tokens_per_step = int_arg("tokens_per_step", tokens_per_step, minimum=1)
        self.world_size = int_arg("world_size", world_size, minimum=1)
        self.accumulation = int_arg("accumulation", accumulation, minimum=1)
        if rank is not None:
            int_arg("rank", rank)
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        self.rank = rank
        self.shuffle = bool_arg("shuffle", shuffle)
        self.seed = int_arg("seed", seed, minimum=0)
        self.epoch = int_arg("epoch", epoch, minimum=0)
        self.attention_tokens = int_arg("attention_tokens", attention_tokens, minimum=0)
        self.drop_last = True  # accelerate: never pad the stream with repeated batches (it is whole steps)
        self._cached: tuple[int, list[list[int]]] | None = None  # (epoch, its steps)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose shuffle the next iteration uses."""
        self.epoch = int_arg("epoch", epoch, minimum=0)

    def steps(self) -> list[list[int]]:
        """This epoch's global batches: the dataset indices of each step, in shuffled order."""
        if self._cached is not None and self._cached[0] == self.epoch:
            return self._cached[1]
        if self.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch]))
            order = rng.permutation(len(self.lengths))
        else:
            order = np.arange(len(self.lengths))
        order = order[self.lengths[order] > 0]
        k = self.world_size * self.accumulation
        steps, current, tokens = [], [], 0
        for i in order.tolist():
            n = int(self.lengths[i])
            if len(current) >= k and tokens + n > self.tokens_per_step:
                steps.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += n
        if len(current) >= k:
            steps.append(current)
        self._cached = (self.epoch, steps)
        return steps

    def plan(self, step: list[int]) -> BalancedPlan:
        """The plan of one global batch (dataset indices), its documents as dataset indices."""
        plan = balance_documents(
            self.lengths[step], self.world_size, self.accumulation, attention_tokens=self.attention_tokens
        )
        documents = tuple(tuple(tuple(step[i] for i in s) for s in rank) for rank in plan.documents)
        return dataclasses.replace(plan, documents=documents)

    def plans(self) -> list[BalancedPlan]:
        """This epoch's plans, one per step (the iteration makes each only when it reaches that step)."""
        return [self.plan(step) for step in self.steps()]

    def __iter__(self):
        steps = self.steps()
        self.epoch += 1
        ranks = range(self.world_size) if self.rank is None else (self.rank,)
        for step in steps:
            plan = self.plan(step)
            for slot in range(self.accumulation):
                for rank in ranks:
                    yield list(plan.documents[rank][slot])

    def __len__(self) -> int:
        per_step = self.accumulation * (self.world_size if self.rank is None else 1)
        return len(self.steps()) * per_step
