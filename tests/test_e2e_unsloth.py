"""The main job's ``unsloth`` column (``fastft.e2e.unsloth``) without Unsloth or a GPU: it is listed,
skipped on CPUs with its reason, its worker's command line and environment, its dispatch and failure record, and
the local model folder its loader reads."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from fastft.e2e import floor, models, report, run, stacks, stream, train
from fastft.e2e import unsloth as worker

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def test_listed_gpu_only_and_skipped_on_cpu_with_its_reason():
    column = stacks.COLUMNS["unsloth"]
    assert column.gpu_only and column.needs == ("unsloth",) and column.peer and not column.fastft
    assert column.own_process
    assert stacks.why_not("unsloth", CPU) == "needs a GPU"
    assert "unsloth" not in stacks.columns(CPU)
    assert "'unsloth': needs a GPU" in run.describe(CPU, True, only=["unsloth"])
    with pytest.raises(RuntimeError, match="process of its own"):
        column.setup(None, "Qwen3-0.6B")


def test_command_line():
    argv = worker.command("Qwen3-0.6B", "padding-free", False, 3, 10, "/tmp/r.json", "cuda")
    assert argv[:3] == [sys.executable, "-m", "fastft.e2e.unsloth"]
    args = dict(zip(argv[3::2], argv[4::2]))
    assert args == {
        "--model": "Qwen3-0.6B",
        "--stream": "padding-free",
        "--loader": "FastLanguageModel",
        "--warmup": "3",
        "--steps": "10",
        "--device": "cuda",
        "--json": "/tmp/r.json",
    }
    tiny = worker.command("Qwen3-30B-A3B", "fixed", True, 1, 2, "out.json", CPU, quant="nf4")
    assert tiny[tiny.index("--loader") + 1] == "FastModel"  # MoE models load through FastModel
    assert tiny[tiny.index("--device") + 1] == "cpu" and "--tiny" in tiny
    assert tiny[tiny.index("--quant") + 1] == "nf4" and "--quant" not in argv and "--tiny" not in argv
    assert worker.loader("Qwen3.5") == "FastModel"  # Gated DeltaNet layers


def test_environment_offline_quiet_and_allocator():
    base = {"PATH": "/bin", "PYTHONPATH": f"/tmp/site{os.pathsep}{worker._ROOT}"}
    env = worker.environment("/tmp/compiled", base)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "UNSLOTH_DISABLE_STATISTICS"):
        assert env[key] == "1"
    assert env["UNSLOTH_COMPILE_LOCATION"] == "/tmp/compiled" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(os.pathsep) == [worker._ROOT, "/tmp/site"]
    # no setting in the benchmark's process: Unsloth's default, and the record will say it differs
    assert env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True" and env["FASTFT_PARENT_ALLOC_CONF"] == ""
    same = worker.environment("/tmp/c", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    assert same["PYTORCH_ALLOC_CONF"] == same["FASTFT_PARENT_ALLOC_CONF"] == "expandable_segments:False"
    assert "PYTORCH_ALLOC_CONF" not in base  # the base is not changed


def test_importing_the_main_job_imports_no_unsloth():
    code = (
        "import sys, fastft, fastft.e2e.run, fastft.e2e.unsloth, fastft.e2e.command, fastft.__main__\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'unsloth', 'unsloth_zoo', 'trl'})\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _fake_worker(monkeypatch, code: str):
    """The column's worker replaced by ``python -c code`` (argv[1]: where the record goes)."""

    def command(name, kind, tiny, warmup, steps, out, device="cuda", quant=None, layers=None):
        return [sys.executable, "-c", code, out, str(warmup), str(steps)]

    monkeypatch.setattr(worker, "command", command)


def test_a_failing_worker_gives_a_nan_record_with_the_fields_of_the_others(monkeypatch, capfd):
    _fake_worker(monkeypatch, "import sys; print('worker says why', file=sys.stderr); sys.exit(3)")
    batches = stream.stream_batches("Qwen3-0.6B", "padding-free", True, 3, CPU)
    record = run._run_column("Qwen3-0.6B", "padding-free", "unsloth", CPU, True, batches, 1)
    assert "worker says why" in capfd.readouterr().err  # the worker's stderr is the benchmark's
    assert "status 3" in record["error"] and record["column"] == "unsloth" and record["peak_gib"] is None
    assert len(record["losses"]) == 3 and all(math.isnan(x) for x in record["losses"])
    result = train.Steps([1.0] * 3, [0.1] * 3, [0] * 3, [0] * 3, -1)
    facts = stacks.record_facts("unsloth", "Qwen3-0.6B", True)
    reference = train.record(
        "Qwen3-0.6B", "padding-free", "unsloth", batches, 1, result, dtype="bfloat16", lora=True, quant=None, **facts
    )
    reference = floor.with_floor(reference, "Qwen3-0.6B", batches, 1, CPU, tiny=True)
    assert set(record) == set(reference) | {"error"}
    report.format_table([record])  # a failed column still makes a row


def test_the_worker_record_is_read_back_and_its_rows_checked(monkeypatch):
    batches = stream.stream_batches("Qwen3-0.6B", "padding-free", True, 3, CPU)
    written = {"column": "unsloth", "backend": "sdpa", "row_tokens": [b.num_tokens for b in batches]}
    code = f"import json, sys; json.dump({written!r}, open(sys.argv[1], 'w'))"
    _fake_worker(monkeypatch, code)
    assert worker.run_column("Qwen3-0.6B", "padding-free", "unsloth", CPU, True, batches, 1) == written
    _fake_worker(monkeypatch, code.replace(str(written["row_tokens"]), "[1, 2, 3]"))
    with pytest.raises(RuntimeError, match="other rows"):
        worker.run_column("Qwen3-0.6B", "padding-free", "unsloth", CPU, True, batches, 1)


@pytest.mark.parametrize("name", ["Qwen3-0.6B", "Qwen3-30B-A3B"])
def test_local_model_folder_round_trips_offline(tmp_path, monkeypatch, name):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(models.model_config(name, tiny=True))
    worker.save_model(model, str(tmp_path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "</s>" and len(tokenizer) == 256
    assert tokenizer("word1 word7 nothing")["input_ids"] == [5, 11, 1]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    saved = dict(model.state_dict())
    assert loaded.state_dict().keys() == saved.keys()
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model.config.model_type
