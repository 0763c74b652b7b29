"""The e2e benchmark on hybrid models (Qwen3.5, Qwen3.5-MoE: Gated DeltaNet layers before each attention layer):
stock packed rows leak across documents and are marked so, the padded peer ('stock sdpa, padded') gives each
document its own row and is each document alone, and fastft's packed losses equal the padded peer's. Tiny
configs on CPU, fastft's torch backend (the interpreter's kernels are tested in their own files)."""

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from fastft.e2e import models, report, run, stacks  # noqa: E402
from fastft.e2e.stream import IGNORE, PAD_ID, micro_batches, packed_batch, padded  # noqa: E402

HYBRIDS = ("Qwen3.5", "Qwen3.5-MoE", "Qwen3-Next")


def _lengths(rng, count, low, high):
    return [int(n) for n in torch.randint(low, high + 1, (count,), generator=rng)]


def test_padded_micro_batches_hold_each_document_once_in_order(rng):
    budget = 128
    batch = packed_batch(_lengths(rng, 12, 1, 60), 1000, rng)
    parts = padded(batch, budget)
    assert tuple(n for p in parts for n in p.seq_lengths) == batch.seq_lengths
    start = 0
    for p in parts:
        rows, width = p.input_ids.shape
        assert rows == len(p.seq_lengths) and width == max(p.seq_lengths) and rows * width <= budget
        assert p.labels.shape == p.attention_mask.shape == p.input_ids.shape
        assert p.targets == sum(n - 1 for n in p.seq_lengths)
        for i, n in enumerate(p.seq_lengths):
            assert torch.equal(p.input_ids[i, :n], batch.input_ids[0, start : start + n])
            assert torch.equal(p.labels[i, :n], batch.labels[0, start : start + n])
            assert (p.input_ids[i, n:] == PAD_ID).all() and (p.labels[i, n:] == IGNORE).all()
            assert p.attention_mask[i].tolist() == [1] * n + [0] * (width - n)
            start += n
    for a, b in zip(parts, parts[1:]):  # greedy in the packed order: the next document did not fit
        assert (len(a.seq_lengths) + 1) * max(*a.seq_lengths, b.seq_lengths[0]) > budget


def test_padded_columns_micro_batch_budget():
    # Granite's stock padded step takes micro-batches of the stream's longest document; the others the row's
    assert models.padded_budget("Granite-4.0-H-Tiny", tiny=False) == 4096 == max(models.sft_lengths(10**6))
    assert models.budget("Granite-4.0-H-Tiny", tiny=False) == 16384
    for name in ("Qwen3.5", "Qwen3-0.6B", "gpt-oss-20b"):
        assert models.padded_budget(name, tiny=False) == models.budget(name, tiny=False)
    assert models.padded_budget("Granite-4.0-H-Tiny", tiny=True) == models.budget("Granite-4.0-H-Tiny", tiny=True)
    batch = packed_batch([4096, 3000, 900, 120, 4000], 1000, torch.Generator().manual_seed(0))
    parts = micro_batches(stacks.column_inputs("stock sdpa, padded", batch, "Granite-4.0-H-Tiny", tiny=False))
    assert [tuple(p["attention_mask"].sum(-1).tolist()) for p, _ in parts] == [(4096,), (3000,), (900, 120), (4000,)]
    assert stacks.record_facts("stock sdpa, padded", "Granite-4.0-H-Tiny", tiny=False)["padded_budget"] == 4096


def test_hybrid_models_in_the_table():
    for name in HYBRIDS:
        config = models.model_config(name, tiny=True)
        assert config.layer_types == ["linear_attention", "full_attention"]  # one layer of each kind
        assert models.model_config(name, tiny=False).layer_types == ["linear_attention"] * 3 + ["full_attention"]
        assert models.has_mixers(name)
        assert stacks.leaks("stock sdpa", name) and stacks.leaks("naive glue", name)
        assert not (stacks.leaks("stock sdpa, padded", name) or stacks.leaks("fastft", name))
        assert stacks.why_not_on("stock sdpa, fla", name) is None
        # transformers refuses flex_attention for these classes: the flex columns are not run on them
        config = models.model_config(name, tiny=True)
        assert not transformers.AutoModelForCausalLM._model_mapping[type(config)]._supports_flex_attn
        assert stacks.why_not_on("stock flex", name) and stacks.why_not_on("liger + stock flex", name)
    assert stacks.why_not_on("stock flex", "Qwen3-0.6B") is None
    assert models.is_moe("Qwen3.5-MoE") and not models.is_moe("Qwen3.5")
    assert not models.has_mixers("Qwen3-0.6B") and stacks.leaks("stock sdpa", "Qwen3-0.6B") is None
    assert stacks.why_not_on("stock sdpa, fla", "Qwen3-0.6B") == "needs a model with linear-attention layers"


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.usefixtures("transformers_torch_delta_rule")
def test_padded_rows_are_each_document_alone_and_packed_rows_leak(name, rng):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(models.model_config(name, tiny=True)).eval()
    model.set_attn_implementation("sdpa")
    batch = packed_batch(_lengths(rng, 5, 8, 40), 256, rng)
    starts = torch.tensor((0, *batch.seq_lengths)).cumsum(0).tolist()
    docs = [slice(a, b) for a, b in zip(starts, starts[1:])]
    with torch.no_grad():
        alone = [model(input_ids=batch.input_ids[:, d]).logits[0] for d in docs]
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
        rows = [(p, model(**p.inputs()).logits) for p in padded(batch, 64)]  # several micro-batches
        step = stacks.column_inputs("stock sdpa, padded", batch, name, tiny=True)
        loss = sum(w * model(**inputs).loss for inputs, w in micro_batches(step))
    own = [row[:n] for p, logits in rows for row, n in zip(logits, p.seq_lengths)]
    assert max(float((a - b).abs().max()) for a, b in zip(own, alone)) <= 1e-5
    assert max(float((packed[d] - a).abs().max()) for d, a in zip(docs[1:], alone[1:])) > 1e-3  # stock leaks
    # the padded step's loss is the packed row's loss with each document alone
    targets = torch.cat([batch.labels[0, d][1:] for d in docs])
    expected = F.cross_entropy(torch.cat([a[:-1] for a in alone]), targets)
    assert abs(float(loss) - float(expected)) <= 1e-5 * float(expected)


def test_e2e_qwen35_marks_leaks_and_checks_fastft_against_the_padded_peer(tmp_path, capsys, monkeypatch):
    from fastft.__main__ import main

    path = tmp_path / "e2e.json"
    names = ["naive glue", "stock sdpa", "stock sdpa, padded", "fastft"]
    args = ["e2e", "--model", "Qwen3.5", *[f"--column={c}" for c in names]]
    assert main([*args, "--stream=fixed", "--steps=1", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    rows = {r["column"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == names
    assert {c: r["leaks"] for c, r in rows.items()} == dict(zip(names, (True, True, False, False)))
    assert [c for c, r in rows.items() if r["padded"]] == ["stock sdpa, padded"]
    assert rows["stock sdpa, padded"]["tokens_min"] == rows["fastft"]["tokens_min"] == 256  # real tokens only
    assert 0 <= rows["stock sdpa, padded"]["padding"] < 1 and rows["fastft"]["padding"] == 0
    assert all(r["layers"] == 2 and len(r["losses"]) == 2 for r in rows.values())
    assert "| stock sdpa (leaks across documents) |" in out and "| naive glue (leaks across documents) |" in out
    assert "| fastft | " in out
    if torch.cuda.is_available():
        assert "x (stock sdpa, padded) |" in out  # the only peer that does not leak
    assert "  Qwen3.5, fixed, against stock sdpa, padded (2 steps, " in out
    assert "'stock sdpa' " in out and "FAILS" not in out
    assert out.splitlines()[-1].startswith("loss check: PASS — 1 fastft column equals the reference within ")


def test_e2e_qwen35_moe_fastft_equals_the_padded_peer(monkeypatch):
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    cpu = torch.device("cpu")
    names = ["stock sdpa, padded", "fastft"]
    records = run.run(cpu, True, ["Qwen3.5-MoE"], names, stream="padding-free", warmup=1, steps=1)
    assert [r["column"] for r in records] == names and not any(r["leaks"] for r in records)
    ok, text = report.loss_check(records)
    assert ok and "  Qwen3.5-MoE, padding-free, against stock sdpa, padded (2 steps, " in text
    assert text.splitlines()[-1].startswith("loss check: PASS — 1 fastft column equals")


def test_mamba2_hybrid_in_the_table():
    """Granite-4.0-H-Tiny: Mamba-2 layers with an attention layer at every tenth, a MoE MLP in each."""
    name = "Granite-4.0-H-Tiny"
    config = models.model_config(name, tiny=True)
    mamba, attention = "linear_attention", "full_attention"  # the config's names for "mamba" and "attention"
    assert config.layer_types == [mamba, attention]  # one layer of each kind
    real = models.model_config(name, tiny=False)
    assert real.num_hidden_layers == 10 and real.layer_types == [mamba] * 5 + [attention] + [mamba] * 4
    assert real.mamba_n_heads * real.mamba_d_head == real.mamba_expand * real.hidden_size
    assert models.model_config(name, False, layers="all").layer_types.count(attention) == 4
    assert models.model_config(name, False, layers=3).layer_types == [mamba] * 3
    assert models.has_mixers(name) and models.is_moe(name)
    assert stacks.leaks("stock sdpa", name) and not stacks.leaks("stock sdpa, padded", name)
    assert stacks.why_not_on("naive glue", name).startswith("its attention layers get no position ids")
    assert stacks.why_not_on("fastft + liger", name).startswith("needs a model whose family")
    assert stacks.why_not_on("fastft, experts lora", name) is None


def test_e2e_mamba2_hybrid_fastft_equals_the_padded_peer(monkeypatch):
    """fastft (and LoRA on the experts, which PEFT finds under ``block_sparse_moe``) trains Granite's packed rows
    as the padded peer trains each document alone."""
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    cpu = torch.device("cpu")
    names = ["stock sdpa, padded", "stock sdpa", "fastft", "fastft, experts lora"]
    records = run.run(cpu, True, ["Granite-4.0-H-Tiny"], names, stream="padding-free", warmup=1, steps=1)
    assert [r["column"] for r in records] == names
    assert [bool(r["leaks"]) for r in records] == [False, True, False, False]
    ok, text = report.loss_check(records)
    assert ok and text.splitlines()[-1].startswith("loss check: PASS — 2 fastft columns equal")


def test_lora_on_granite_experts_finds_them():
    pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(models.model_config("Granite-4.0-H-Tiny", tiny=True))
    model, lora = stacks._peft(model, "Granite-4.0-H-Tiny", experts=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert lora and any("block_sparse_moe.experts" in n and "lora_A" in n for n in names), names


@pytest.mark.skipif(stacks.installed("flash-linear-attention"), reason="checks the line for a missing fla")
def test_flash_linear_attention_columns_are_named_when_missing():
    text = run.describe(torch.device("cpu"), True)
    for column in ("stock sdpa, fla", "stock sdpa, padded, fla"):
        assert f"\n    '{column}': needs flash-linear-attention (pip install flash-linear-attention)" in text


def test_audit_on_qwen35(capsys):
    from fastft.__main__ import main

    assert main(["audit", "--model", "Qwen3.5", "--steps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5, column 'fastft', padding-free stream (tiny config)" in out
    assert "fastft's torch paths" in out  # a CPU's default backend
    assert "Qwen3_5GatedDeltaNet" in out and "host syncs 0" in out


def test_host_lengths_give_fastft_the_same_step(rng, monkeypatch):
    """The stream's boundaries as a flattening collator's host ``cu_seq_lens_q`` (what keeps fastft free of host
    syncs) train the same step as device ``position_ids``."""
    from fastft.integrations.transformers import apply

    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    batch = packed_batch(_lengths(rng, 6, 1, 40), 200, rng)
    inputs = batch.inputs(host_lengths=True)
    cu = inputs["cu_seq_lens_q"]
    assert cu.device.type == "cpu" and cu.dtype == torch.int32 and inputs["cu_seq_lens_k"] is cu
    assert cu.tolist() == [0, *torch.tensor(batch.seq_lengths).cumsum(0).tolist()]
    assert inputs["max_length_q"] == inputs["max_length_k"] == max(batch.seq_lengths)
    assert stacks.column_inputs("fastft", batch, "Qwen3.5", True, host_lengths=True).keys() == inputs.keys()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(models.model_config("Qwen3.5", tiny=True))
    apply(model, lora=False)
    results = []
    for step in (batch.inputs(), inputs):
        model.zero_grad(set_to_none=True)
        loss = model(**step).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and len(grads_a) == len(grads_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_audit_with_host_lengths_on_qwen35(capsys):
    from fastft.__main__ import main

    assert main(["audit", "--model", "Qwen3.5", "--steps", "1", "--device", "cpu", "--host-lengths"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3.5, column 'fastft', padding-free stream, boundaries as host cu_seq_lens_q (tiny config)" in out
