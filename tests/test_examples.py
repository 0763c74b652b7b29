"""examples/: each script runs (few steps, CPU here), its stock and fastft losses agree and its documents stay
apart (the scripts check both and exit 1 otherwise); fastft's pieces are still in place after training."""

import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

import fastft  # noqa: E402
import fastft.integrations.transformers as ft_hf  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_fastft_kept(model):
    inner = ft_hf.hf_model(model)
    assert inner.config._attn_implementation == "fastft"
    layers = [m for m in inner.modules() if hasattr(m, "_gradient_checkpointing_func") and m.gradient_checkpointing]
    assert layers and all(m._gradient_checkpointing_func is fastft.offload.gradient_checkpointing_func for m in layers)


def test_trainer_example():
    example = load("trainer")
    assert example.main(["--steps", "3", "--device", "cpu"]) == 0
    model = example.apply(example.tiny_model("cpu"))
    example.train(model, example.documents(8), 2, "cpu")
    assert_fastft_kept(model)


def test_trl_example():
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    example = load("trl_sft")
    assert example.main(["--steps", "2", "--device", "cpu"]) == 0
    model = example.apply(example.tiny_model("cpu"))
    example.train(model, example.tiny_tokenizer(), example.text_dataset(16), "packing", 2, "cpu")
    assert_fastft_kept(model)


def test_trl_grpo_example(monkeypatch):
    """Generate, score and train with TRL's GRPOTrainer: the first step's completions are the stock model's
    tokens, the losses and gradient norms agree, and the training forwards ran fastft's packed attention."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from fastft.integrations.transformers import attention

    calls = []
    packed = attention.packed_attention
    monkeypatch.setattr(attention, "packed_attention", lambda *a, **k: calls.append(1) or packed(*a, **k))
    example = load("trl_grpo")
    assert example.main(["--steps", "2", "--device", "cpu"]) == 0
    assert calls  # fastft's attention trained, and stepped aside in generation (the tokens are the stock ones)
    model = example.apply(example.tiny_model("cpu"))
    example.train(model, example.tiny_tokenizer(), example.prompts(4), 1, "cpu")
    assert_fastft_kept(model)
