"""fastft.balance_documents against its specification (fastft/reference/balance.py) and the bounds it states;
the sampler that gives each rank its share of every global batch (fastft.integrations.balance)."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fastft
from fastft.reference import balance as reference

lengths_strategy = st.lists(st.integers(0, 5000), max_size=120) | st.lists(  # a few long documents among short ones
    st.one_of(st.integers(1, 300), st.integers(2000, 40000)), max_size=60
)
shape_strategy = st.tuples(st.integers(1, 8), st.integers(1, 4))  # (world_size, accumulation)
attention_strategy = st.sampled_from([0, 1, 4096, fastft.balance.DEFAULT_ATTENTION_TOKENS])


def flat(plan_field):
    return [x for rank in plan_field for x in rank]


@given(lengths_strategy, shape_strategy, attention_strategy)
def test_matches_the_specification_and_states_its_sums(lengths, shape, attention_tokens):
    world, accumulation = shape
    plan = fastft.balance_documents(lengths, world, accumulation, attention_tokens=attention_tokens)
    want = reference.balance(lengths, world, accumulation, attention_tokens)
    assert [[list(s) for s in rank] for rank in plan.documents] == want
    cost = reference.costs(lengths, attention_tokens)
    assert plan.costs == tuple(tuple(sum(cost[i] for i in s) for s in rank) for rank in want)
    assert plan.tokens == tuple(tuple(sum(lengths[i] for i in s) for s in rank) for rank in want)
    assert plan.largest == max(cost, default=0)


@given(lengths_strategy, shape_strategy, attention_strategy)
def test_every_document_once_and_the_bounds(lengths, shape, attention_tokens):
    world, accumulation = shape
    k = world * accumulation
    lengths = np.array(lengths, dtype=np.int64)
    plan = fastft.balance_documents(lengths, world, accumulation, attention_tokens=attention_tokens)
    assert len(plan.documents) == world and all(len(rank) == accumulation for rank in plan.documents)
    placed = flat(plan.documents)
    assert sorted(i for s in placed for i in s) == list(range(lengths.size))  # each exactly once
    assert all(list(s) == sorted(s) for s in placed)
    costs = flat(plan.costs)
    mean = sum(costs) / k
    assert max(costs) - min(costs) <= plan.largest  # the stated spread
    assert max(costs) <= mean + (1 - 1 / k) * plan.largest + 1e-6 * max(mean, 1)
    for p in (0.01, 0.05, 0.2):  # "within p of the mean whenever no document is that large a part of it"
        if plan.largest <= p * mean * k / max(k - 1, 1):
            assert plan.imbalance <= p + 1e-9
    for slot in range(accumulation):  # each slot's micro-batches are adjacent in cost: their spread too
        in_slot = [plan.costs[r][slot] for r in range(world)]
        assert max(in_slot) - min(in_slot) <= plan.largest


def optimum(cost, k):
    """The least possible heaviest bin (brute force over every assignment)."""
    best = None
    for assignment in itertools.product(range(k), repeat=len(cost)):
        loads = [0] * k
        for c, b in zip(cost, assignment):
            loads[b] += c
        best = max(loads) if best is None else min(best, max(loads))
    return best


@given(st.lists(st.integers(0, 3000), max_size=7), st.integers(1, 3), attention_strategy)
def test_within_grahams_bound_of_the_best_plan(lengths, k, attention_tokens):
    plan = fastft.balance_documents(lengths, k, attention_tokens=attention_tokens)
    best = optimum(reference.costs(lengths, attention_tokens), k)
    assert max(flat(plan.costs)) * 3 * k <= (4 * k - 1) * best  # (4/3 - 1/(3k)) x optimal, in integers


def test_one_huge_document_cannot_be_balanced_and_says_so():
    plan = fastft.balance_documents([100_000] + [10] * 50, world_size=4)
    assert plan.costs[0][0] == plan.largest  # alone in its micro-batch
    assert plan.imbalance > 2.5  # reported, not hidden


def test_long_documents_weigh_more_than_their_tokens():
    """With the quadratic term a long document's micro-batch gets fewer tokens: the attention work evens out."""
    lengths = [16384] + [512] * 64
    by_tokens = fastft.balance_documents(lengths, 2, attention_tokens=0)
    by_cost = fastft.balance_documents(lengths, 2, attention_tokens=4096)
    assert max(flat(by_tokens.tokens)) - min(flat(by_tokens.tokens)) <= 512
    heavy = next(r for r in range(2) if 0 in by_cost.documents[r][0])
    assert by_cost.tokens[heavy][0] < by_cost.tokens[1 - heavy][0] - 16384 // 2


@given(lengths_strategy, shape_strategy)
def test_deterministic_and_input_types_agree(lengths, shape):
    world, accumulation = shape
    plans = [
        fastft.balance_documents(x, world, accumulation)
        for x in (lengths, tuple(lengths), np.array(lengths, dtype=np.int32), torch.tensor(lengths, dtype=torch.int64))
    ]
    assert all(p == plans[0] for p in plans)
    assert fastft.balance_documents(lengths, world, accumulation) == plans[0]


def test_empty_and_fewer_documents_than_micro_batches():
    plan = fastft.balance_documents([], 2, 2)
    assert plan.documents == (((), ()), ((), ())) and plan.imbalance == 0.0 and plan.largest == 0
    plan = fastft.balance_documents([5, 3], 2, 2)
    assert sorted(len(s) for s in flat(plan.documents)) == [0, 0, 1, 1]


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match="lengths must hold integers, got float"):
        fastft.balance_documents([1, 2.5], 2)
    with pytest.raises(TypeError, match="lengths must hold integers, got bool"):
        fastft.balance_documents([True, 2], 2)
    with pytest.raises(TypeError, match="lengths must hold integers, got a float32 array"):
        fastft.balance_documents(np.ones(3, dtype=np.float32), 2)
    with pytest.raises(TypeError, match="lengths must hold integers, got a torch.float32 tensor"):
        fastft.balance_documents(torch.ones(3), 2)
    with pytest.raises(TypeError, match="lengths must be a list, tuple, numpy array or CPU tensor"):
        fastft.balance_documents({1, 2}, 2)
    with pytest.raises(TypeError, match="lengths must be a list"):
        fastft.balance_documents("12", 2)
    with pytest.raises(ValueError, match="lengths must be 1-D"):
        fastft.balance_documents(np.ones((2, 2), dtype=np.int64), 2)
    with pytest.raises(ValueError, match="lengths must be >= 0, got -1"):
        fastft.balance_documents([3, -1], 2)
    with pytest.raises(ValueError, match="more than 2147483647 tokens"):
        fastft.balance_documents([2**31], 2)
    with pytest.raises(ValueError, match="more than 2147483647 tokens"):
        fastft.balance_documents(np.array([2**63], dtype=np.uint64), 2)
    with pytest.raises(TypeError, match="world_size must be an int"):
        fastft.balance_documents([1], 2.0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        fastft.balance_documents([1], 0)
    with pytest.raises(ValueError, match="accumulation must be an int >= 1"):
        fastft.balance_documents([1], 1, 0)
    with pytest.raises(TypeError, match="attention_tokens must be an int"):
        fastft.balance_documents([1], 1, attention_tokens=0.5)
    with pytest.raises(ValueError, match="attention_tokens must be an int >= 0"):
        fastft.balance_documents([1], 1, attention_tokens=-1)
    with pytest.raises(ValueError, match="past 2\\*\\*60"):
        fastft.balance_documents([2**31 - 1] * 300, 2, attention_tokens=2**31 - 1)


@pytest.mark.gpu
def test_a_gpu_tensor_is_refused_not_read():
    with pytest.raises(ValueError, match="lengths must be on the host"):
        fastft.balance_documents(torch.ones(3, dtype=torch.int64, device="cuda"), 2)


# ---- the sampler ----------------------------------------------------------------------------------------------


def sampler(lengths, **kwargs):
    from fastft.integrations.balance import BalancedBatchSampler

    options = dict(tokens_per_step=2000, world_size=2, accumulation=2, seed=3)
    return BalancedBatchSampler(lengths, **{**options, **kwargs})


LENGTHS = [int(n) for n in np.random.default_rng(0).integers(1, 700, 200)]


def test_sampler_ranks_share_every_step_and_every_document_once():
    full = sampler(LENGTHS)
    count = len(full)  # (the next iteration's: an iteration moves to the next epoch)
    batches = list(full)
    assert len(batches) == count and count % 4 == 0
    ranks = [list(sampler(LENGTHS, rank=r)) for r in range(2)]
    assert [len(r) for r in ranks] == [len(batches) // 2] * 2
    # rank r's micro-batches are every world_size-th batch of the whole stream (what accelerate hands rank r)
    assert ranks == [batches[r::2] for r in range(2)]
    seen = sorted(i for b in batches for i in b)
    assert len(seen) == len(set(seen)) and all(b for b in batches)
    assert len(set(range(len(LENGTHS))) - set(seen)) < 4  # only the last step's remainder (< world x accumulation)
    full.set_epoch(0)
    for step in full.plans():  # each step: its global batch (within the budget, or one document per
        docs = [i for rank in step.documents for s in rank for i in s]  # micro-batch) split by balance_documents
        assert sum(LENGTHS[i] for i in docs) <= 2000 or len(docs) <= 4
        assert step.tokens == tuple(tuple(sum(LENGTHS[i] for i in s) for s in rank) for rank in step.documents)
        assert max(flat(step.costs)) - min(flat(step.costs)) <= step.largest


def test_sampler_is_deterministic_for_a_seed_and_reshuffles_each_epoch():
    a, b = sampler(LENGTHS), sampler(LENGTHS)
    first = list(a)
    assert first == list(b)
    assert list(a) != first  # the next epoch: another shuffle
    b.set_epoch(1)
    assert list(b) == list(sampler(LENGTHS, seed=3, epoch=1))
    assert list(sampler(LENGTHS, seed=4)) != first
    assert [sorted(x) for x in sampler(LENGTHS, shuffle=False)] == [sorted(x) for x in sampler(LENGTHS, shuffle=False)]


def test_sampler_with_accelerate_gives_each_process_its_share():
    """accelerate's prepare (Trainer, TRL) wraps a batch sampler in BatchSamplerShard: process r takes every
    world_size-th batch, which is this sampler's rank r."""
    shard = pytest.importorskip("accelerate.data_loader").BatchSamplerShard
    for r in range(2):
        assert list(shard(sampler(LENGTHS), num_processes=2, process_index=r)) == list(sampler(LENGTHS, rank=r))
        assert len(shard(sampler(LENGTHS), num_processes=2, process_index=r)) == len(sampler(LENGTHS, rank=r))


def test_sampler_errors():
    with pytest.raises(TypeError, match="tokens_per_step must be an int"):
        sampler(LENGTHS, tokens_per_step=1.5)
    with pytest.raises(ValueError, match="tokens_per_step must be an int >= 1"):
        sampler(LENGTHS, tokens_per_step=0)
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\)"):
        sampler(LENGTHS, rank=2)
    with pytest.raises(TypeError, match="shuffle must be True or False"):
        sampler(LENGTHS, shuffle="yes")
    with pytest.raises(TypeError, match="lengths must hold integers"):
        sampler([1.5, 2])


def test_sampler_under_transformers_trainer(tmp_path):
    """A Trainer whose train dataloader takes the sampler (the documented override): it trains on exactly the
    sampler's micro-batches, each one packed row (DataCollatorWithFlattening)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch.utils.data import DataLoader

    from fastft.integrations.balance import BalancedBatchSampler
    from fastft.testing import tiny_hf_model

    lengths = [int(n) for n in np.random.default_rng(1).integers(2, 40, 40)]
    dataset = [{"input_ids": list(range(i, i + n))} for i, n in enumerate(lengths)]  # first id: the index
    seen = []
    flatten = transformers.DataCollatorWithFlattening()

    def collate(features):
        seen.append([f["input_ids"][0] for f in features])
        return flatten(features)

    def make_sampler():
        return BalancedBatchSampler(lengths, tokens_per_step=120, world_size=1, accumulation=2, seed=5)

    class BalancedTrainer(transformers.Trainer):
        def get_train_dataloader(self):
            loader = DataLoader(self.train_dataset, batch_sampler=make_sampler(), collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        gradient_accumulation_steps=2,
        max_steps=3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        remove_unused_columns=False,
    )
    model = tiny_hf_model("llama")
    BalancedTrainer(model=model, args=args, train_dataset=dataset, data_collator=collate).train()
    want = [list(b) for b in make_sampler()][:6]
    assert seen[:6] == want and len(seen) >= 6
