import os

import torch

# Deterministic cuBLAS for the tests that call torch.use_deterministic_algorithms (read when CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

if not torch.cuda.is_available():
    # No GPU: the Triton backend runs in Triton's interpreter on CPU tensors (set before Triton is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")

# Interpreter runs are slow: fewer examples on CPU. Inputs are drawn fresh every run (no fixed seed).
settings.register_profile(
    "fastft",
    max_examples=200 if GPU else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("fastft")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    return DEVICE


@pytest.fixture
def rng():
    """A ``torch.Generator`` seeded fresh each run (``FASTFT_TEST_SEED`` fixes it); the seed is printed, so
    a failing test shows it under "Captured stdout setup" and can be rerun with it."""
    seed = int(os.environ.get("FASTFT_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"rng seed: {seed} (rerun with FASTFT_TEST_SEED={seed})")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def grads_close():
    """``torch.testing.assert_close`` for one gradient, and its norm within ``rel`` of the expected one's:
    with bf16's elementwise tolerance near a tiny model's gradients (1e-3 to 2e-2), a zero or wrongly scaled
    gradient passes the first check but not the second (``rel`` 0.1)."""

    def check(got, want, *, msg="", rel=0.1, **tol):
        torch.testing.assert_close(got, want, msg=msg, **tol)
        norm = want.float().norm()
        if norm > 0:
            err = float((got.float() - want.float()).norm() / norm)
            assert err <= rel, f"{msg}: the difference's norm is {err:.3g} of the gradient's (at most {rel})"

    return check


@pytest.fixture
def transformers_torch_delta_rule(monkeypatch):
    """transformers' own ``torch_chunk_gated_delta_rule`` in its Gated DeltaNet families for the test: where
    flash-linear-attention is installed transformers calls its kernels instead, which take no CPU tensors and
    autotune at every new shape. fastft's replacement (``apply``) still takes the place of either."""
    import importlib
    import inspect

    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"):
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        fn = getattr(module, "torch_chunk_gated_delta_rule", None)
        if fn is not None and fn.__module__ == module.__name__:  # transformers' (not a live fastft model's)
            monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", inspect.unwrap(fn))
