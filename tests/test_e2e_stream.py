"""The main job's stream of fresh packed batches (fastft.e2e.stream) and its host-side parts: the rules of the
columns table, the schedule, the loss check and its verdict, the table; the CLI runs of the whole job are in
test_cli.py."""

import itertools
import types

import pytest
import torch

from fastft.e2e import report, run, stacks, train
from fastft.e2e.models import MODEL_CONFIGS, has_sinks, is_moe, model_config, num_experts
from fastft.e2e.stream import IGNORE, KINDS, pack, packed_stream, regroup, streams_of


def _seed(rng) -> int:
    return int(torch.randint(2**31, (), generator=rng))


def _take(kind, seed, n=8, budget=1024):
    return list(itertools.islice(packed_stream(kind, budget, seed, median=60, vocab=1000), n))


@pytest.mark.parametrize("kind", KINDS)
def test_stream_is_the_same_for_a_seed_and_new_every_step(kind, rng):
    seed = _seed(rng)
    first, again = _take(kind, seed), _take(kind, seed)
    for a, b in zip(first, again):
        assert a.seq_lengths == b.seq_lengths and a.num_tokens == b.num_tokens
        for field in ("input_ids", "position_ids", "labels"):
            assert torch.equal(getattr(a, field), getattr(b, field))
    assert len({b.seq_lengths for b in first}) == len(first)  # new documents each step
    assert not torch.equal(first[0].input_ids[:, :16], first[1].input_ids[:, :16])
    assert _take(kind, seed + 1)[0].seq_lengths != first[0].seq_lengths


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_packed_documents_with_boundaries_masked(kind, rng):
    for b in _take(kind, _seed(rng)):
        assert b.input_ids.shape == b.position_ids.shape == b.labels.shape == (1, b.num_tokens)
        assert b.num_tokens == sum(b.seq_lengths) <= 1024 and all(n > 0 for n in b.seq_lengths)
        expected = torch.cat([torch.arange(n) for n in b.seq_lengths])[None]
        assert torch.equal(b.position_ids, expected)
        starts = b.position_ids == 0
        assert (b.labels[starts] == IGNORE).all() and int(starts.sum()) == len(b.seq_lengths)
        assert torch.equal(b.labels[~starts], b.input_ids[~starts])  # the model shifts them itself
        assert b.input_ids.dtype == b.labels.dtype == b.position_ids.dtype == torch.int64
        assert 0 <= int(b.input_ids.min()) and int(b.input_ids.max()) < 1000


def test_fixed_rows_fill_the_budget_and_padding_free_rows_hold_whole_documents(rng):
    seed = _seed(rng)
    fixed, free = _take("fixed", seed, 12), _take("padding-free", seed, 12)
    assert {b.num_tokens for b in fixed} == {1024}
    assert len({b.num_tokens for b in free}) > 1  # the token count changes step to step
    for f, p in zip(fixed, free):  # the same documents, packed two ways
        n = len(p.seq_lengths)
        assert f.seq_lengths[:n] == p.seq_lengths
        # the next document did not fit whole: the fixed row holds it cut to the budget's rest
        assert p.num_tokens == 1024 or f.seq_lengths[n] == 1024 - p.num_tokens
        assert torch.equal(f.input_ids[:, : p.num_tokens], p.input_ids)


def _documents(rows):
    """Each document of ``rows`` as (token ids, labels), in order."""
    out = []
    for row in rows:
        for ids, labels in zip(row.input_ids[0].split(row.seq_lengths), row.labels[0].split(row.seq_lengths)):
            out.append((ids, labels))
    return out


def test_regroup_packs_the_documents_again_one_row_per_group(rng):
    rows = _take("padding-free", _seed(rng), 3)
    documents = _documents(rows)
    order = torch.randperm(len(documents), generator=rng).tolist()
    groups = [order[: len(order) // 3], order[len(order) // 3 :]]
    out = regroup(rows, groups)
    assert len(out) == 2
    for row, group in zip(out, groups):
        assert row.seq_lengths == tuple(len(documents[i][0]) for i in group) and row.num_tokens == sum(row.seq_lengths)
        assert torch.equal(row.position_ids, torch.cat([torch.arange(n) for n in row.seq_lengths])[None])
        for (ids, labels), i in zip(_documents([row]), group, strict=True):
            assert torch.equal(ids, documents[i][0]) and torch.equal(labels, documents[i][1])
    with pytest.raises(ValueError, match=r"groups\[1\] is empty"):
        regroup(rows, [order, []])
    with pytest.raises(ValueError, match=r"groups\[0\] has document numbers outside"):
        regroup(rows, [[len(documents)]])


@pytest.mark.parametrize("world", [2, 3])
def test_distributed_shares_hold_the_same_documents_both_ways(world):
    from fastft import balance_documents
    from fastft.e2e import distributed

    rows = distributed.shares("Qwen3-0.6B", True, world, 3, "rows")
    balanced = distributed.shares("Qwen3-0.6B", True, world, 3, "balanced")
    assert len(rows) == len(balanced) == 3 and all(len(s) == world for s in rows + balanced)
    for step_rows, step_balanced in zip(rows, balanced):

        def key(d):
            return tuple(d[0].tolist())

        assert sorted(map(key, _documents(step_rows))) == sorted(map(key, _documents(step_balanced)))
        lengths = [n for row in step_rows for n in row.seq_lengths]
        plan = balance_documents(lengths, world, attention_tokens=12 * model_config("Qwen3-0.6B", True).hidden_size)
        assert [r.num_tokens for r in step_balanced] == [t[0] for t in plan.tokens]
    with pytest.raises(ValueError, match="split must be one of"):
        distributed.shares("Qwen3-0.6B", True, 2, 1, "sorted")


def test_distributed_records_from_each_rank_and_one_gpu():
    """The numbers of ``e2e --nproc`` from hand-made step times: two steps of two shares each."""
    from fastft.e2e.distributed import _record

    def result(step_s, tokens):
        return {"step_s": step_s, "tokens": tokens, "prime_s": 1.0, "first_s": [0.5], "peak": 2**30}

    base = [{"rows": result([1.0, 3.0, 2.0, 2.0], [100, 300, 200, 200])}]  # [step 0: share 0, 1; step 1: ...]
    job = dict(name="Qwen3-0.6B", tiny=True, column="fastft", parts=2, steps=2, warmup=1, mode="ddp")
    ranks = [{"rows": result([3.5, 2.5], [100, 200])}, {"rows": result([3.4, 2.4], [300, 200])}]
    r = _record(job, 2, "rows", ranks, base)
    assert r["step_ms"] == pytest.approx(3000.0)  # the slowest rank's steps: 3.5 and 2.5 s
    assert r["scaling"] == pytest.approx(8.0 / 6.0)  # one GPU: 8 s for the same shares
    assert r["tokens_per_s_per_gpu"] == pytest.approx(800 / 6.0 / 2)
    assert r["one_gpu_tokens_per_s"] == pytest.approx(100.0)
    assert r["work_ms"] == pytest.approx([1500.0, 2500.0]) and r["wait_ms"] == pytest.approx([1500.0, 500.0])
    assert r["imbalance"] == pytest.approx((1.5 + 1.0) / 2 - 1)  # step 0: 3 / 2; step 1: 2 / 2
    assert r["token_imbalance"] == pytest.approx((1.5 + 1.0) / 2 - 1)
    assert r["rank_step_ms"] == pytest.approx([3000.0, 2900.0]) and r["first_steps_s"] == pytest.approx(1.5)

    one = _record(dict(job, mode="ep"), 1, "rows", [{"rows": result([1.1, 3.1, 2.0, 2.2], [100, 300, 200, 200])}], base)
    assert one["step_ms"] == pytest.approx(4200.0) and one["scaling"] == pytest.approx(8.0 / 8.4)
    assert one["work_ms"] is one["wait_ms"] is one["imbalance"] is None

    hf = _record(dict(job, mode="hf ep"), 2, "rows", [{"rows": result([0.8, 1.6], [100, 200])}] * 2, base)
    assert hf["scaling"] == pytest.approx(3.0 / 2.4)  # one GPU: rank 0's shares alone, 1 + 2 s
    assert hf["tokens_per_s_per_gpu"] == pytest.approx(300 / 2.4 / 2) and hf["wait_ms"] is None


def test_pack():
    assert pack("fixed", [5, 7, 9], 10) == [5, 5]
    assert pack("padding-free", [5, 7, 9], 10) == [5]
    assert pack("padding-free", [5, 5, 9], 10) == [5, 5]
    with pytest.raises(ValueError, match="do not fill a fixed row of 20"):
        pack("fixed", [5, 7], 20)


def test_bad_stream_arguments_fail_at_the_call():
    with pytest.raises(ValueError, match="kind must be one of 'fixed', 'padding-free', got 'packed'"):
        packed_stream("packed", 1024)
    with pytest.raises(ValueError, match="budget must be a positive int, got 0"):
        packed_stream("fixed", 0)
    with pytest.raises(ValueError, match=r"max_len must be an int in \[16, budget=64\], got 65"):
        packed_stream("fixed", 64, max_len=65)
    with pytest.raises(ValueError, match="stream must be one of 'fixed', 'padding-free', 'both', got 'all'"):
        streams_of("all")
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        train.schedule(True, steps=0)
    assert streams_of(None) == ("padding-free",) and streams_of("both") == KINDS
    assert train.schedule(True) == (1, 2) and train.schedule(False) == (3, 20)
    assert train.schedule(False, 2, 50) == (2, 50)


def test_the_columns_table_keeps_its_rules():
    for name, c in stacks.COLUMNS.items():
        assert c.name == name
        # fastft's columns are compared with the peers; the peers are the users' stacks without fastft
        assert c.fastft == name.startswith("fastft") and not (c.fastft and c.peer)
        assert c.peer == (not c.fastft and name != "naive glue")
        assert c.padded == ("padded" in name)
        # the name says what a column needs: Liger (a GPU package), CUDA graphs, LoRA on the experts (peft, MoE)
        assert ("liger-kernel" in c.needs) == ("liger" in name)
        assert ("flash-linear-attention" in c.needs) == name.endswith(", fla") == c.mixers_only
        assert c.moe_only == ("experts lora" in name)
        if c.moe_only:
            assert "peft" in c.needs
        if "liger" in name or "graphs" in name or "hf offload" in name or c.own_process:
            assert c.gpu_only, name
        assert c.own_process == (name == "unsloth")
    assert list(stacks.COLUMNS)[:3] == ["naive glue", "stock sdpa", "stock sdpa, padded"]  # the references first
    assert report.REFERENCES == ("naive glue", "stock sdpa", "stock sdpa, padded")


def test_which_columns_run_here():
    c, cpu = stacks.COLUMNS, torch.device("cpu")
    assert stacks.why_not("stock flex", cpu) == "needs a GPU"
    assert set(stacks.columns(cpu)) == {n for n in c if not c[n].gpu_only and stacks.why_not(n, cpu) is None}
    # named columns run in the order named (to move one-time costs off a column), each once; GPU-only ones dropped
    named = ["stock sdpa", "fastft", "naive glue", "fastft", "stock flex"]
    assert stacks.columns(cpu, named) == ["stock sdpa", "fastft", "naive glue"]


def test_one_answer_to_is_this_model_moe():
    for name, (config, fields, _) in MODEL_CONFIGS.items():
        experts = fields.get("num_experts", fields.get("num_local_experts", 0))
        moe_config = "Moe" in config or config in ("GptOssConfig", "Qwen3NextConfig")
        assert is_moe(name) == (experts > 0) == moe_config, name
        assert num_experts(name) == experts and num_experts(name, tiny=True) == (8 if experts else 0)
        assert has_sinks(name) == (config == "GptOssConfig")
    assert is_moe("Qwen3.5-MoE") and not is_moe("Qwen3.5")


def test_a_cpu_runs_one_dense_one_moe_and_one_hybrid_model_by_default():
    cpu, cuda = torch.device("cpu"), types.SimpleNamespace(type="cuda")
    assert [run.kind_of(n) for n in run.models_of(cpu)] == ["dense", "MoE", "hybrid"]
    assert run.models_of(cpu, everything=True) == run.models_of(cuda) == list(MODEL_CONFIGS)
    assert run.models_of(cpu, ["Qwen3.5-MoE"]) == ["Qwen3.5-MoE"] and run.kind_of("Qwen3.5-MoE") == "hybrid MoE"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skipped columns of a CPU run")
def test_skipped_columns_one_a_line():
    text = run.describe(torch.device("cpu"), True, ["fastft", "stock sdpa, hf offload", "fastft + liger, graphs"])
    assert "\n    'stock sdpa, hf offload': needs a GPU\n    'fastft + liger, graphs': needs a GPU\n" in text
    assert "'stock flex'" not in text  # not asked for


def _record(column, losses, tokens_per_s, model="Qwen3-0.6B", stream="padding-free"):
    step_ms = 1000 * 1000 / tokens_per_s
    zero = dict(compiles_first=0, compiles_timed=0, captures_first=0, captures_timed=0)
    return dict(
        zero,
        model=model,
        stream=stream,
        column=column,
        layers=2,
        dtype="float32",
        losses=losses,
        loss=losses[0],
        tokens_per_s=tokens_per_s,
        step_ms=step_ms,
        first_steps_s=1.5,
        warmup=1,
        tokens_min=900,
        tokens_max=1000,
        peak_gib=None,
        leaks=False,
    )


def test_loss_check_compares_every_step_and_ends_with_one_verdict():
    base = [2.0, 1.9, 1.8]
    records = [_record("naive glue", base, 100.0), _record("fastft", base, 300.0)]
    ok, text = report.loss_check(records + [_record("stock sdpa", [2.0, 1.9, 1.9], 200.0)])
    assert ok and "'stock sdpa' 5.6e-02 (step 2) (differs)" in text and "(3 steps, " in text
    assert text.splitlines()[-1] == (
        "loss check: PASS — 1 fastft column equals the reference within 1e-4 relative at every step "
        "(largest difference 0.0e+00)"
    )
    ok, text = report.loss_check(records + [_record("fastft, peft lora", [2.0, 1.91, 1.8], 250.0)])
    assert not ok and "'fastft, peft lora' 5.3e-03 (step 1) FAILS" in text
    assert text.splitlines()[-1].startswith("loss check: FAIL — 1 of 2 fastft columns differ from the reference: ")
    other = [_record(r["column"], r["losses"], 1.0, stream="fixed") for r in records]
    ok, text = report.loss_check(records + other)
    assert text.count("  Qwen3-0.6B, ") == 2 and "PASS — 2 fastft columns" in text  # one line per stream


def test_a_fastft_column_that_did_not_finish_fails_the_check():
    base = [2.0, 1.9, 1.8]
    nan = _record("fastft", [2.0, float("nan"), 1.8], 300.0)
    ok, text = report.loss_check([_record("naive glue", base, 100.0), nan])
    assert not ok and "'fastft' did not finish (a loss is not finite)" in text.splitlines()[-1]
    oom = {**_record("fastft", [float("nan")] * 3, 300.0), "error": "out of memory"}
    ok, text = report.loss_check([_record("naive glue", base, 100.0), oom])
    assert not ok and "'fastft' did not finish (out of memory)" in text


def test_no_reference_no_verdict_of_equality():
    ok, text = report.loss_check([_record("fastft", [2.0], 300.0)])
    assert ok and text == (
        "loss check: not run — no fastft column ran beside a reference column (naive glue, stock sdpa, "
        "stock sdpa, padded)"
    )


def test_table_compares_fastft_with_the_fastest_peer_of_its_stream():
    records = [
        _record("stock sdpa", [2.0], 100.0),
        _record("stock sdpa, hf offload", [2.0], 150.0),
        _record("fastft", [2.0], 300.0),
        _record("stock sdpa", [2.0], 50.0, stream="fixed"),
        _record("fastft", [2.0], 300.0, stream="fixed"),
    ]
    table = report.format_table(records)
    row = "| padding-free | 900-1000 | fastft | 300 | 3333.3 | 1.5 (1) | - | - | n/a | - |"
    assert row + " 2.00x (stock sdpa, hf offload) |" in table
    assert "| fixed | 900-1000 | fastft | 300 | 3333.3 | 1.5 (1) | - | - | n/a | - | 6.00x (stock sdpa) |" in table
    assert "| stock sdpa | 100 | 10000.0 | 1.5 (1) | - | - | n/a | 3.00x | - |" in table
    assert "vs fastest peer  fastft columns: this column's tokens/s / the highest tokens/s" in report.legend()
    # a CPU run: no speed ratios, nor the columns that hold nothing there
    cpu = report.format_table(records, ratios=False)
    head = "| model | layers | stream | tokens/step | column | tokens/s | step ms | first steps s |"
    assert cpu.splitlines()[0] == head and "| padding-free | 900-1000 | fastft | 300 | 3333.3 | 1.5 (1) |" in cpu
    assert "x (" not in cpu and "x |" not in cpu
    assert "vs fastest peer" not in report.legend(ratios=False)


def test_train_counts_what_torch_compile_compiles_in_each_step():
    linear = torch.nn.Linear(4, 1)
    loss = torch.compile(lambda x: linear(x).square().mean(), backend="eager", dynamic=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return types.SimpleNamespace(loss=loss(x))

    inputs = [{"x": torch.randn(n, 4)} for n in (3, 3, 5, 5, 7)]  # a new shape: a recompile
    seen = []
    steps = train.train(Model(), inputs, 2, torch.device("cpu"), on_step=lambda *a: seen.append(a[:2]))
    assert steps.compiles == [1, 0, 1, 0, 1] and steps.captures == [0] * 5
    assert len(steps.losses) == len(steps.seconds) == 5 and all(s > 0 for s in steps.seconds)
    assert steps.peak_bytes == -1  # no GPU memory to count
    assert seen == [(i, 5) for i in range(5)]  # progress after each step


def test_train_primed_times_a_second_pass_and_counts_the_first_as_first_steps(monkeypatch):
    calls = []

    def fake_train(model, inputs, warmup, device, lr=1e-5, on_step=None):
        calls.append(lr)
        first = lr == 0
        return train.Steps(
            losses=[9.0, 8.0, 7.0] if first else [1.0, 2.0, 3.0],
            seconds=[5.0, 2.0, 2.0] if first else [0.5, 0.25, 0.25],
            compiles=[3, 1, 0] if first else [0, 0, 0],
            captures=[4, 0, 2] if first else [1, 0, 0],
            peak_bytes=100 if first else 80,
        )

    monkeypatch.setattr(train, "train", fake_train)
    gpu = types.SimpleNamespace(type="cuda")
    steps = train.train_primed(None, [{}] * 3, 1, gpu)
    assert calls == [0.0, 1e-5]  # learning rate 0 first: no weight changes before the measured pass
    assert steps.losses == [1.0, 2.0, 3.0] and steps.seconds == [0.5, 0.25, 0.25] and steps.peak_bytes == 80
    assert steps.compiles == [4, 0, 0] and steps.captures == [7, 0, 0] and steps.prime_s == 9.0
    calls.clear()
    assert train.train_primed(None, [{}] * 3, 1, torch.device("cpu")).prime_s == 0 and calls == [1e-5]


@pytest.mark.gpu
def test_train_primed_leaves_the_weights_to_the_second_pass():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).cuda()
    start = {k: v.clone() for k, v in model.state_dict().items()}

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = model

        def forward(self, x):
            return types.SimpleNamespace(loss=self.linear(x).square().mean())

    inputs = [{"x": torch.randn(4 + n, 8, device="cuda")} for n in range(4)]
    primed = train.train_primed(Loss(), inputs, 1, torch.device("cuda"))
    model.load_state_dict(start)
    plain = train.train(Loss(), inputs, 1, torch.device("cuda"))
    torch.testing.assert_close(primed.losses, plain.losses, rtol=1e-6, atol=0)  # the first pass moved no weight
    assert primed.prime_s > 0


def test_a_peer_that_fails_is_its_rows_result_and_fastft_failing_stops_the_run(monkeypatch, capsys):
    """A peer's own error (flash-linear-attention refusing Hopper's Triton) is recorded with the row; fastft's
    columns never hide one."""

    def refuse(*args, **kwargs):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")

    monkeypatch.setattr(train, "train", refuse)
    cpu = torch.device("cpu")
    (record,) = run.run(cpu, True, ["Qwen3-0.6B"], ["stock sdpa"], stream="fixed", warmup=1, steps=1)
    assert (
        record["error"].startswith("RuntimeError: Triton >= 3.4.0") and record["tokens_per_s"] != record["tokens_per_s"]
    )
    assert "stock sdpa             failed: RuntimeError: Triton >= 3.4.0" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="Hopper"):
        run.run(cpu, True, ["Qwen3-0.6B"], ["fastft"], stream="fixed", warmup=1, steps=1)
