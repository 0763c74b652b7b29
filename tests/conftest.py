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
