"""The main job's compute floor (``fastft.e2e.floor``), its column in the table, ``--layers`` and the memory-plan
columns: counts against hand counts from the configs' widths, the record fields on a CPU (none), the report."""

import math

import pytest
import torch

from fastft.e2e import floor, models, report, stacks, stream, train
from fastft.e2e import unsloth as worker

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
R = floor.LORA_RANK


def _dense(h, i, heads, kv, d, vocab, layers, tokens, lengths):
    """A Qwen3/Llama step by hand: 7 projections with LoRA, the head, causal attention."""
    linears = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h), (h, i), (h, i), (i, h)]
    per_token = layers * sum(4 * a * b + 6 * R * (a + b) for a, b in linears) + 4 * h * vocab
    attention = layers * sum(3 * 4 * heads * d * n * (n + 1) // 2 for n in lengths)
    return per_token * tokens + attention


def test_dense_step_flops_are_the_hand_count():
    lengths = [700, 16, 4096, 1234]
    got = floor.step_flops("Qwen3-0.6B", lengths, layers=3)
    assert got == _dense(1024, 3072, 16, 8, 128, 151936, 3, sum(lengths), lengths)
    got = floor.step_flops("Llama-3.2-1B", lengths)  # the table's 16 layers
    assert got == _dense(2048, 8192, 32, 8, 64, 128256, 16, sum(lengths), lengths)
    # the full depth: every layer's share, the head's once
    one, full = floor.step_flops("Qwen3-8B", [512], 1), floor.step_flops("Qwen3-8B", [512], "all")
    head = 4 * 4096 * 151936 * 512
    assert full - head == pytest.approx(36 * (one - head), rel=1e-12)


def test_moe_step_flops_count_each_tokens_experts_only():
    h, moe, heads, kv, d, vocab, top = 2048, 768, 32, 4, 128, 151936, 8
    attention = [(h, heads * d), (h, kv * d), (h, kv * d), (heads * d, h)]
    per_token = sum(4 * a * b + 6 * R * (a + b) for a, b in attention)  # LoRA on attention only
    per_token += top * 4 * (h * 2 * moe + moe * h)  # gate_up and down of 8 of 128 experts; the router is no Linear
    per_token += 4 * h * vocab
    lengths = [300, 2000]
    expected = per_token * 2300 + sum(3 * 4 * heads * d * n * (n + 1) // 2 for n in lengths)
    assert floor.step_flops("Qwen3-30B-A3B", lengths, layers=1) == expected


def test_sliding_window_pairs_and_hybrid_layers():
    for n in (1, 5, 127, 128, 129, 1000):
        for window in (0, 1, 16, 128, 2000):
            brute = sum(min(i + 1, window) if window else i + 1 for i in range(n))
            assert floor.causal_pairs(n, window) == brute, (n, window)
    # gpt-oss alternates sliding (128) and full attention layers
    _, attention = floor._model_counts("gpt-oss-20b", None)
    assert [w for w, _ in attention] == [128, 0, 128, 0] and {x for _, x in attention} == {64 * 64}
    # Qwen3.5: 3 Gated DeltaNet layers (projections counted, no attention term) and 1 attention layer
    _, attention = floor._model_counts("Qwen3.5", None)
    assert attention == ((0, 16 * 256),)


def test_a_cpu_record_has_no_floor_and_the_table_shows_it_only_when_measured():
    batches = stream.stream_batches("Qwen3-0.6B", "padding-free", True, 3, CPU)
    result = train.Steps([1.0] * 3, [0.1] * 3, [0] * 3, [0] * 3, -1)
    facts = stacks.record_facts("fastft", "Qwen3-0.6B", True)
    row = train.record(
        "Qwen3-0.6B", "padding-free", "fastft", batches, 1, result, dtype="float32", lora=True, quant=None, **facts
    )
    cpu = floor.with_floor(row, "Qwen3-0.6B", batches, 1, CPU, tiny=True)
    assert cpu["floor_ms"] is None and cpu["gemm_tflops"] is None
    assert "x floor" not in report.format_table([cpu])
    measured = {**cpu, "step_ms": 250.0, "floor_ms": 100.0}
    table = report.format_table([measured])
    assert "| x floor |" in table and "| 2.50x |" in table
    assert "x floor" not in report.format_table([measured], ratios=False)
    failed = {**measured, "step_ms": math.nan, "error": "out of memory"}  # a failed column keeps its row
    header, _, ok, bad = (line.split(" | ") for line in report.format_table([measured, failed]).splitlines())
    assert ok[header.index("x floor")] == "2.50x" and bad[header.index("x floor")] == "n/a"
    assert "x floor" in report.legend() and "x floor" not in report.legend(ratios=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the floor is measured on a GPU")
def test_a_gpu_record_has_its_floor():
    batches = stream.stream_batches("Qwen3-0.6B", "padding-free", False, 2, "cuda")
    row = floor.with_floor({}, "Qwen3-0.6B", batches, 1, "cuda", tiny=False)
    rate = row["gemm_tflops"] * 1e12
    assert 10e12 < rate < 5e15  # a dense bf16 GEMM on any CUDA GPU fastft runs on
    assert row["floor_ms"] == pytest.approx(1e3 * floor.step_flops("Qwen3-0.6B", batches[1].seq_lengths) / rate)


def test_the_fastest_peer_says_when_unsloth_ran_on_its_fallback():
    def rec(column, tokens_per_s, **extra):
        return {
            "model": "M",
            "stream": "padding-free",
            "column": column,
            "tokens_per_s": tokens_per_s,
            "leaks": False,
            **extra,
        }

    fallback = "sdpa (flash-attn no, xformers no, torch varlen_attn no; calls: ...)"
    records = [rec("unsloth", 100.0, backend=fallback), rec("fastft", 250.0)]
    assert report._fastest_peer(records, records[1]) == "2.50x (unsloth, SDPA fallback)"
    records[0]["backend"] = "flash_varlen (flash-attn yes, xformers no, torch varlen_attn no; calls: ...)"
    assert report._fastest_peer(records, records[1]) == "2.50x (unsloth)"
    assert worker.on_fallback({"backend": fallback}) and not worker.on_fallback({})


def test_layers_are_checked_and_reach_every_builder():
    assert models.layers_arg("Qwen3-8B", None) == 8 and models.layers_arg("Qwen3-8B", "all") == 36
    assert models.model_config("Qwen3-14B", False, "all").num_hidden_layers == 40
    assert models.model_config("Qwen3.5", False, 8).layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    for bad in (0, 37, True, "36", 2.0):
        with pytest.raises(ValueError, match=r"layers must be an int in \[1, 36\] or 'all' for Qwen3-8B"):
            models.layers_arg("Qwen3-8B", bad)
    with pytest.raises(ValueError, match="real size only"):
        models.model_config("Qwen3-8B", True, 4)
    assert stacks.record_facts("fastft", "Qwen3-8B", False, "all")["layers"] == 36
    argv = worker.command("Qwen3-14B", "padding-free", False, 2, 8, "r.json", "cuda", "nf4", "all")
    assert argv[argv.index("--layers") + 1] == "all"
    assert "--layers" not in worker.command("Qwen3-14B", "padding-free", False, 2, 8, "r.json")


def test_memory_plan_columns_plan_for_the_rows_budget():
    from fastft.integrations.transformers import memory_planner

    for name in ("fastft, memory plan", "fastft + liger, memory plan"):
        column = stacks.COLUMNS[name]
        assert column.fastft and column.gpu_only and not column.peer
        assert stacks.why_not(name, CPU) == "needs a GPU"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(models.model_config("Qwen3-0.6B", True))
    model, lora, restore = stacks.COLUMNS["fastft, memory plan"].setup(model.train(), "Qwen3-0.6B")
    planner = memory_planner(model)
    assert planner is not None and planner.memory_budget == "auto"
    assert planner.max_tokens == models.budget("Qwen3-0.6B", tiny=False) == 16384
    restore()


def test_floor_counts_and_rate_shapes_for_every_model():
    for name in models.MODEL_CONFIGS:
        flops = floor.step_flops(name, [100, 2000])
        assert math.isfinite(flops) and flops > 0, name
        m, k, n = floor.gemm_shape(name)  # Qwen3.5-MoE's config has no dense MLP width
        assert m == models.budget(name, False) and k == models.model_config(name, False).hidden_size and n > 0, name
    assert floor.gemm_shape("Qwen3-8B") == (16384, 4096, 12288)  # the dense MLP's
    assert floor.gemm_shape("Qwen3-14B") == (16384, 5120, 17408)
