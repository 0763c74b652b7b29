"""Offloaded checkpointing on a CUDA GPU: bit-identical gradients, semantics, races, memory."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fastft
from fastft import offload

pytestmark = pytest.mark.gpu

FORCE = offload.OffloadConfig(enabled=True, double_buffer=True, min_bytes=0)
SINGLE = offload.OffloadConfig(enabled=True, double_buffer=False, min_bytes=0)


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def torch_ckpt(f, *args, **kwargs):
    return checkpoint(f, *args, use_reentrant=False, **kwargs)


def ours(config):
    return lambda f, *args, **kwargs: fastft.offloaded_checkpoint(f, *args, offload_config=config, **kwargs)


class Block(torch.nn.Module):
    """RMSNorm -> MLP with dropout -> residual, computing in ``dtype`` on an fp32 residual stream."""

    def __init__(self, width, out, dtype, g):
        super().__init__()
        self.norm = torch.nn.Parameter(1 + 0.1 * torch.randn(width, generator=g).cuda())
        self.up = torch.nn.Parameter((torch.randn(width, 2 * width, generator=g) / width**0.5).to("cuda", dtype))
        self.down = torch.nn.Parameter(
            (torch.randn(2 * width, out, generator=g) / (2 * width) ** 0.5).to("cuda", dtype)
        )
        self.skip = (
            torch.nn.Parameter(torch.randn(width, out, generator=g).cuda() / width**0.5) if out != width else None
        )
        self.dtype = dtype

    def forward(self, x, delay_cycles=0):
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)  # a slow layer: the copy engine must not race ahead of compute
        h = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * self.norm
        h = F.dropout(F.silu(h.to(self.dtype) @ self.up), p=0.1, training=True) @ self.down
        return (x if self.skip is None else x @ self.skip) + h.float()


def make_stack(widths, dtypes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.ModuleList(Block(a, b, d, g) for a, b, d in zip(widths, widths[1:], dtypes))


def run(stack, ckpt, x, delays=None):
    torch.manual_seed(7)
    for i, block in enumerate(stack):
        x = ckpt(block, x, delay_cycles=delays[i] if delays else 0)
    return x.square().mean()


def grads(stack, ckpt, x, delays=None):
    params = ([x] if x.requires_grad else []) + list(stack.parameters())
    loss = run(stack, ckpt, x, delays)
    return [loss.detach(), *torch.autograd.grad(loss, params)]


def assert_identical(actual, expected):
    assert len(actual) == len(expected)
    for i, (a, b) in enumerate(zip(actual, expected)):
        assert torch.equal(a, b), f"tensor {i} differs: max |diff| {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("config", [FORCE, SINGLE], ids=["double", "single"])
def test_eight_layers_bit_identical_to_torch_checkpoint(config):
    stack = make_stack([512] * 9, [torch.bfloat16, torch.float32] * 4)
    x = torch.randn(4096, 512, device="cuda", requires_grad=True)
    expected = grads(stack, torch_ckpt, x)
    off = offload.offloader_for(x, config)
    before = dict(off.stats)
    actual = grads(stack, ours(config), x)
    assert_identical(actual, expected)
    delta = {k: off.stats[k] - before[k] for k in before}
    assert delta["offloaded_bytes"] == 8 * x.numel() * 4
    # the last layer's input is still on the GPU when backward starts; the other 7 come back from the host,
    # all but the first of them (layer 7's, issued when layer 8's backward starts) prefetched
    assert delta["kept_on_device"] == 1 and delta["reloads"] == 7
    assert delta["reused_reloads"] == (7 if off.num_buffers == 2 else 0)
    assert off.stats["fresh_buffers"] == 0


@pytest.mark.parametrize("view", ["transposed", "sliced", "expanded"])
def test_non_contiguous_inputs(view):
    stack = make_stack([256] * 5, [torch.float32] * 4)
    base = torch.randn(2048, 512, device="cuda")
    x = {
        "transposed": base[:, :256].t().contiguous().t(),
        "sliced": base[:, ::2],
        "expanded": base[:1, :256].expand(2048, 256),
    }[view]
    x.requires_grad_(view != "expanded")  # an expanded leaf cannot require grad
    assert_identical(grads(stack, ours(FORCE), x), grads(stack, torch_ckpt, x))


def test_semantics_tuples_kwargs_shared_inputs_two_forwards_autograd_grad():
    g = torch.Generator().manual_seed(1)
    w = [torch.randn(256, 256, generator=g).cuda().requires_grad_() for _ in range(4)]
    gate = torch.randn(256, generator=g).cuda().requires_grad_()

    def layer(x, w, *, gate, scale):  # returns a tuple; a tensor kwarg and a non-tensor kwarg
        h = F.dropout(torch.tanh(x @ w), p=0.2) * scale
        return x + h * gate, h.sum()

    def model(ckpt, x0, x_const):
        x, aux = ckpt(layer, x0, w[0], gate=gate, scale=0.5)
        x, a = ckpt(layer, x, w[1], gate=gate, scale=2.0)
        y, b = ckpt(layer, x0, w[2], gate=gate, scale=1.0)  # x0 is shared with the first layer
        z, c = ckpt(layer, x_const, w[3], gate=gate, scale=1.0)  # an input that does not require grad
        return (x * y).mean() + z.mean() + aux + a + b + c

    def both(ckpt):
        torch.manual_seed(3)
        xa = torch.randn(4096, 256, device="cuda", requires_grad=True)
        xb = torch.randn(4096, 256, device="cuda", requires_grad=True)
        const = torch.randn(4096, 256, device="cuda")
        loss = model(ckpt, xa, const) + 2 * model(ckpt, xb, const)  # two forwards, then one backward
        return [loss.detach(), *torch.autograd.grad(loss, [xa, xb, gate, *w])]

    assert_identical(both(ours(FORCE)), both(torch_ckpt))
    assert_identical(both(ours(SINGLE)), both(torch_ckpt))


def test_no_grad_and_inference_mode_do_not_offload():
    stack = make_stack([256] * 3, [torch.float32] * 2)
    x = torch.randn(4096, 256, device="cuda")
    off = offload.offloader_for(x, FORCE)
    before = off.stats["offloaded_bytes"]
    with torch.no_grad():
        a = run(stack, ours(FORCE), x)
    with torch.inference_mode():
        b = run(stack, ours(FORCE), x)
    assert off.stats["offloaded_bytes"] == before
    assert torch.equal(a, b)


def test_small_inputs_and_disabled_config_checkpoint_without_offload():
    x = torch.randn(64, 64, device="cuda", requires_grad=True)  # 16 KiB < 1 MiB default
    assert offload.offloader_for(x) is None
    assert offload.offloader_for(torch.randn(1024, 1024, device="cuda"), offload.OffloadConfig(enabled=False)) is None
    assert offload.offloader_for(torch.randn(1024, 1024, device="cuda")) is not None  # discrete GPU: offload
    y = fastft.offloaded_checkpoint(torch.sin, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.cos(x.detach()))


def test_stress_random_sizes_and_delays_100_steps(rng):
    rng = random.Random(rng.initial_seed())
    widths = [rng.choice([128, 192, 256, 384, 512]) for _ in range(9)]
    stack = make_stack(
        widths, [rng.choice([torch.float32, torch.bfloat16]) for _ in range(8)], seed=rng.randrange(2**31)
    )
    x = torch.randn(rng.randrange(1024, 4096), widths[0], device="cuda", requires_grad=True)
    expected = grads(stack, torch_ckpt, x)
    off = offload.offloader_for(x, FORCE)
    peaks, held = [], []
    for _ in range(100):
        delays = [rng.choice([0, 0, 10**5, 10**6]) for _ in range(8)]  # up to ~0.5 ms per layer
        torch.cuda.reset_peak_memory_stats()
        assert_identical(grads(stack, ours(FORCE), x, delays), expected)
        peaks.append(torch.cuda.max_memory_allocated())
        held.append(off.pool.held_bytes)
    assert max(peaks[10:]) <= max(peaks[:10]), "peak GPU memory grew across steps"
    assert held[-1] == held[2], "pinned memory grew across steps"
    assert off.stats["fresh_buffers"] == 0


def test_peak_memory_saves_the_layer_inputs():
    stack = make_stack([1024] * 9, [torch.bfloat16] * 8)
    x = torch.randn(8192, 1024, device="cuda", requires_grad=True)
    size = x.numel() * x.element_size()

    def peak(ckpt):
        grads(stack, ckpt, x)  # warm up allocator and pools
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads(stack, ckpt, x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    plain, offloaded = peak(torch_ckpt), peak(ours(FORCE))
    assert offloaded <= plain - (8 - 3) * size, (plain / 2**20, offloaded / 2**20, size / 2**20)


def test_hugging_face_model():
    pytest.importorskip("transformers")
    from fastft.testing import tiny_hf_model

    def step(enable):
        model = tiny_hf_model(
            "llama",
            torch.float32,
            "cuda",
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=4,
            head_dim=64,
            vocab_size=1000,
            max_position_embeddings=2048,
        )
        enable(model)
        ids = torch.randint(0, 1000, (2, 1024), device="cuda")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    expected = step(lambda m: m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}))
    off = offload.offloader_for(torch.empty(2, 1024, 256, device="cuda"), FORCE)
    before = off.stats["offloaded_bytes"]
    from fastft.integrations.transformers import enable_gradient_checkpointing

    actual = step(lambda m: enable_gradient_checkpointing(m, FORCE))
    assert off.stats["offloaded_bytes"] - before == 4 * 2 * 1024 * 256 * 4
    assert_identical(actual, expected)
