"""fastft on a GPU other than the current one: every public op on ``cuda:1`` while ``cuda:0`` is current gives
what it gives on ``cuda:0`` (Triton kernels, autotune, offloader streams and pinned memory, CUDA graphs and
their pools are per device), and a tiny transformers model split over two GPUs (transformers' ``device_map``,
accelerate's hooks) trains one packed step after ``apply`` (offloaded checkpointing, and CUDA graphs) with the
loss and gradients of the same model on one GPU. The tests of ``PackedSeqInfo.to`` run on CPUs too."""

import contextlib
import warnings

import pytest
import torch

import fastft
from fastft import graphs, selfcheck
from fastft.offload import OffloadConfig, offloader_for
from fastft.testing import assert_same, randint, random_strided_tensor

needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs ({torch.cuda.device_count()} here)"
)


def on_both(case, seed: int):
    """``case(device, generator)`` on ``cuda:0`` and on ``cuda:1``, ``cuda:0`` current both times: the results
    (nested tensors) agree, ``cuda:1``'s are on ``cuda:1``, and the current device is still ``cuda:0``."""
    results = []
    for index in (0, 1):
        with torch.cuda.device(0):
            out = case(torch.device("cuda", index), torch.Generator().manual_seed(seed))
            assert torch.cuda.current_device() == 0, "the op changed the current device"
        torch.cuda.synchronize(index)
        results.append(out)
    same(results[1], results[0], f"seed {seed}: cuda:1 vs cuda:0")


def same(got, want, path: str) -> None:
    """Nested results equal: integers exactly, floats as the same kernels give them on two GPUs (backward
    atomics add in any order: fp32 within 1e-5 of the largest value, bf16 within torch's tolerance, two ulps);
    every tensor of ``got`` on ``cuda:1``."""
    if isinstance(want, torch.Tensor):
        assert got.device == torch.device("cuda", 1), f"{path}: on {got.device}"
        tol = {}
        if want.dtype == torch.float32:
            scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
            tol = dict(atol=1e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(got.cpu(), want.cpu(), **tol, msg=lambda m: f"{path}: {m}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            same(a, b, f"{path}[{i}]")
    else:
        assert_same(got, want, path=path)


SEEDS = [0, 1, 2]


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("op", ["packing", "routing", "copy"])
def test_integer_ops_on_another_device(op, seed):
    """packed_seq_info (every field and mask), the routing ops with their gradients, pack/unpack (integers
    exactly; routing's router-weight and table gradients, fp32 sums in any order, within 1e-5)."""

    def case(device, g):
        if op == "packing":
            return selfcheck.packing_outputs(**selfcheck.random_packing_case(g, device, 512))
        if op == "routing":
            return selfcheck.routing_outputs(**selfcheck.random_routing_case(g, device, 256))
        from fastft import copy

        tensors = [random_strided_tensor(g, device, 4096) for _ in range(1 + randint(g, 0, 3))]
        buf, layout = copy.pack(tensors)
        return {"packed": buf[: layout.nbytes], "unpacked": copy.unpack(buf, layout)}

    on_both(case, seed)


def _grads(out, leaves, seed):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad, allow_unused=True)]


def attention_case(device, g):
    case = selfcheck.random_attention_case(g, device, 256)
    info = fastft.packed_seq_info(position_ids=case["position_ids"])
    q, k, v = (case[n].to(torch.bfloat16).requires_grad_() for n in ("q", "k", "v"))
    sinks = None if case["sinks"] is None else case["sinks"].to(torch.bfloat16)
    out = fastft.packed_attention(q, k, v, info, window=case["window"], sinks=sinks)
    return _grads(out, [q, k, v], 1)


def conv_case(device, g):
    n, c, w = 200, 24, 4
    info = fastft.packed_seq_info(seq_lengths=[50, 3, 97, 1, 49], device=device)
    x = torch.randn(n, c, generator=g).to(device).requires_grad_()
    weight = torch.randn(c, w, generator=g).to(device).requires_grad_()
    bias = torch.randn(c, generator=g).to(device).requires_grad_()
    return _grads(fastft.packed_conv1d(x, weight, info, bias=bias, activation="silu"), [x, weight, bias], 2)


def delta_rule_case(device, g):
    b, t, h, d = 1, 150, 2, 16
    info = fastft.packed_seq_info(seq_lengths=[70, 1, 79], device=device)
    q, k = (torch.randn(b, t, h, d, generator=g).to(device).requires_grad_() for _ in range(2))
    v = torch.randn(b, t, h, d, generator=g).to(device).requires_grad_()
    decay = (-torch.rand(b, t, h, generator=g)).to(device).requires_grad_()
    beta = torch.rand(b, t, h, generator=g).to(device).requires_grad_()
    out = fastft.gated_delta_rule(q, k, v, decay, beta, info, chunk_size=32)
    return _grads(out, [q, k, v, decay, beta], 3)


def ssd_case(device, g):
    b, t, h, p, groups, n = 1, 150, 4, 16, 2, 24
    info = fastft.packed_seq_info(seq_lengths=[70, 1, 79], device=device)
    x = torch.randn(b, t, h, p, generator=g).to(device).requires_grad_()
    dt = torch.randn(b, t, h, generator=g).to(device).requires_grad_()
    A = (-torch.rand(h, generator=g) - 0.1).to(device).requires_grad_()
    B, C = (torch.randn(b, t, groups, n, generator=g).to(device).requires_grad_() for _ in range(2))
    out = fastft.packed_ssd_scan(x, dt, A, B, C, info, dt_softplus=True, chunk_size=32)  # the Triton intra path
    return _grads(out, [x, dt, A, B, C], 5)


def selective_scan_case(device, g):
    b, dm, t, n = 1, 24, 150, 8
    info = fastft.packed_seq_info(seq_lengths=[70, 1, 79], device=device)
    u, delta, z = (torch.randn(b, dm, t, generator=g).to(device).requires_grad_() for _ in range(3))
    A = (-torch.rand(dm, n, generator=g) - 0.1).to(device).requires_grad_()
    B, C = (torch.randn(b, n, t, generator=g).to(device).requires_grad_() for _ in range(2))
    D = torch.randn(dm, generator=g).to(device).requires_grad_()
    out = fastft.packed_selective_scan(u, delta, A, B, C, info, D=D, z=z, delta_softplus=True, chunk_size=32)
    return _grads(out, [u, delta, A, B, C, D, z], 6)


def swiglu_case(device, g):
    x = (torch.randn(300, 2 * 40, generator=g) * 4).to(device, torch.bfloat16).requires_grad_()
    return _grads(fastft.swiglu(x, alpha=1.702, limit=7.0, interleaved=True), [x], 4)


def rms_norm_case(device, g):
    x = torch.randn(300, 96, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(96, generator=g).to(device, torch.bfloat16).requires_grad_()
    return _grads(fastft.rms_norm(x, w, offset=1.0), [x, w], 4)


def gated_rms_norm_case(gate_first, activation="silu", group_size=None):
    def case(device, g):
        x, z = (torch.randn(300, 96, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
        w = torch.randn(96, generator=g).to(device, torch.bfloat16).requires_grad_()
        kw = dict(gate=z, gate_first=gate_first, gate_activation=activation, group_size=group_size)
        out = fastft.rms_norm(x, w, **kw)
        return _grads(out, [x, w, z], 4)

    return case


def rotary_case(device, g):
    q = torch.randn(2, 40, 5, 64, generator=g).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 40, 2, 64, generator=g).to(device, torch.bfloat16).transpose(1, 2).requires_grad_()
    angles = torch.randn(1, 40, 32, generator=g).to(device)
    out = fastft.rotary(q, k, angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16))
    return [*(t.detach() for t in out), *torch.autograd.grad(out, [q, k], [torch.ones_like(t) for t in out])]


def swiglu_pair_case(device, g):
    gate, up = (torch.randn(300, 40, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
    return _grads(fastft.swiglu(gate, up), [gate, up], 4)


def linear_cross_entropy_case(device, g):
    x = torch.randn(300, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(500, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 500, (300,), generator=g).to(device)
    loss = fastft.linear_cross_entropy(x, w, labels, softcap=30.0, block_size=128)
    return [loss.detach(), *torch.autograd.grad(loss, [x, w])]


def experts_case(device, g):
    from fastft import experts

    tokens, top_k, hidden, inter, e = 64, 2, 32, 48, 4  # bf16, widths % 8: torch._grouped_mm on CUDA
    ids = torch.randint(-1, e + 1, (tokens, top_k), generator=g).to(device)
    x = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16).requires_grad_()
    weights = torch.rand(tokens, top_k, generator=g).to(device).requires_grad_()
    up = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, torch.bfloat16)
    down = (torch.randn(e, hidden, inter, generator=g) / inter**0.5).to(device, torch.bfloat16)
    lora = [torch.randn(e, 4, hidden, generator=g), torch.randn(e, 2 * inter, 4, generator=g)]
    lora = [(t * 0.1).to(device, torch.bfloat16).requires_grad_() for t in lora]
    out = experts.routed_experts(
        x,
        ids,
        weights,
        up,
        down,
        transposed=False,
        activation=fastft.swiglu,
        up_lora=experts.ExpertLoRA(*lora, 0.5),
    )
    return _grads(out, [x, weights, *lora], 5)


def lora_case(device, g):
    from fastft.lora import lora_linear

    x, weight, bias, lora_a, lora_b, scaling = selfcheck.random_lora_case(g, device, torch.bfloat16)
    return _grads(lora_linear(x, weight, bias, lora_a, lora_b, scaling), [x, lora_a, lora_b], 6)


class Layer(torch.nn.Module):
    """A checkpointable layer: packed attention over ``info`` between two projections (one frozen)."""

    def __init__(self, g, dim=64, heads=4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False).requires_grad_(False)
        self.out = torch.nn.Linear(dim, dim)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x, info):
        t, d = x.shape
        q, k, v = self.qkv(x).view(t, 3, self.heads, d // self.heads).unbind(1)
        return x + self.out(fastft.packed_attention(q, k, v, info).reshape(t, d))


def checkpoint_case(checkpoint):
    def case(device, g):
        layers = torch.nn.ModuleList(Layer(g) for _ in range(3)).to(device, torch.bfloat16)
        info = fastft.packed_seq_info(seq_lengths=[100, 28, 200], device=device)
        x = torch.randn(328, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
        h = x
        config = OffloadConfig(min_bytes=0)  # the layers' inputs offloaded too: the device's offloader works
        offloader = offloader_for(x, config)
        assert offloader.device == device
        before = offloader.stats["offloaded_bytes"]
        for layer in layers:
            h = checkpoint(layer, h, info, offload_config=config)
        assert offloader.stats["offloaded_bytes"] > before, "nothing was offloaded"
        return _grads(h, [x, *[p for p in layers.parameters() if p.requires_grad]], 7)

    return case


def graphed_case(device, g):
    captures = graphs.capture_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the eager path warns
        out = checkpoint_case(fastft.graphed_checkpoint)(device, g)
    assert graphs.capture_count() > captures, "nothing was captured"
    return out


FLOAT_CASES = {
    "attention": attention_case,
    "conv": conv_case,
    "delta_rule": delta_rule_case,
    "ssd": ssd_case,
    "selective_scan": selective_scan_case,
    "swiglu": swiglu_case,
    "rms_norm": rms_norm_case,
    "rms_norm gated": gated_rms_norm_case(False),
    "rms_norm gated first": gated_rms_norm_case(True),
    "rms_norm sigmoid-gated": gated_rms_norm_case(False, "sigmoid"),
    "rms_norm gated in groups": gated_rms_norm_case(True, group_size=32),
    "rotary": rotary_case,
    "swiglu apart": swiglu_pair_case,
    "linear_cross_entropy": linear_cross_entropy_case,
    "experts": experts_case,
    "lora": lora_case,
    "offloaded_checkpoint": checkpoint_case(fastft.offloaded_checkpoint),
    "graphed_checkpoint": graphed_case,
}


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("op", list(FLOAT_CASES))
def test_float_ops_on_another_device(op, seed):
    """Forward and gradients of every float op, and both checkpoints: as on cuda:0 (the same kernels;
    backward atomics add in any order)."""
    on_both(FLOAT_CASES[op], seed)


# ---- a transformers model split over two GPUs ----------------------------------------------------------------


LENGTHS = [9, 30, 1, 24]  # one packed row of documents


def packed_batch(device):
    ids = torch.randint(0, 128, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return dict(input_ids=ids.to(device), labels=ids.to(device), position_ids=positions.to(device))


def split_map(config) -> dict:
    """transformers' device_map of a tiny model (its config): the embedding and the first half of the layers on
    cuda:0, the rest, the norm and the head on cuda:1."""
    layers = config.num_hidden_layers
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    placement.update({f"model.layers.{i}": int(i >= layers // 2) for i in range(layers)})
    return placement


def step(model, device):
    """Loss and gradients (on the CPU, by name) of one packed step."""
    model.zero_grad(set_to_none=True)
    loss = model(**packed_batch(device)).loss
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float().cpu(), grads


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("graphed", [False, True], ids=["offload", "graphs"])
@pytest.mark.parametrize("family, lora", [("llama", False), ("llama", True), ("qwen3_moe", False)])
def test_model_split_over_two_gpus_trains_as_on_one(family, lora, graphed, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import fastft.integrations.transformers as ft_hf
    from fastft.testing import tiny_hf_model

    monkeypatch.setenv("FASTFT_OFFLOAD_MIN_BYTES", "0")  # the tiny layers' inputs are offloaded too
    # bf16 experts run torch._grouped_mm; fp32 ones its fallback, which syncs the host: no graph captures it
    dtype = torch.bfloat16 if family == "qwen3_moe" else torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    path = str(tmp_path / "model")
    tiny_hf_model(family, num_hidden_layers=4).save_pretrained(path)

    def build(device_map):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map)
        if lora:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
            with torch.no_grad():  # both adapters drawn from their names: the same on one GPU and on two
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
        return ft_hf.apply(model.train(), graphs=graphed)

    one = build({"": 0})
    want = [step(one, "cuda:0") for _ in range(2)]
    del one
    split = build(split_map(transformers.AutoConfig.from_pretrained(path)))
    devices = {p.device for p in ft_hf.decoder_layers(split)[-1].parameters()}
    assert devices == {torch.device("cuda", 1)}, f"the last layer is on {devices}"
    offloader = offloader_for(torch.empty(1, device="cuda:1"))
    offloaded = offloader.stats["offloaded_bytes"]
    captures = graphs.capture_count()
    with _no_graph_fallback() if graphed else contextlib.nullcontext():
        got = [step(split, "cuda:0") for _ in range(2)]  # the second: graphs replayed, buffers reused
    assert offloader.stats["offloaded_bytes"] > offloaded, "nothing was offloaded on cuda:1"
    if graphed:
        assert graphs.capture_count() > captures
    for (loss, grads), (loss_want, grads_want) in zip(got, want):
        torch.testing.assert_close(loss, loss_want, **tol)
        assert grads.keys() == grads_want.keys() and grads
        for name, grad in grads_want.items():
            torch.testing.assert_close(grads[name], grad, **tol, msg=name)


@contextlib.contextmanager
def _no_graph_fallback():
    """No layer falls back to the eager path (each fallback warns once per layer and reason)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    fallbacks = [str(w.message) for w in caught if "without CUDA graphs" in str(w.message)]
    assert not fallbacks, fallbacks


# ---- PackedSeqInfo.to ---------------------------------------------------------------------------------------


def test_info_to_its_own_device_is_itself_and_checks_its_argument():
    info = fastft.packed_seq_info(seq_lengths=[3, 2])
    assert info.to("cpu") is info and info.to(torch.device("cpu")) is info
    with pytest.raises(TypeError, match="device must be a torch.device, str or int, got float"):
        info.to(1.0)
    with pytest.raises(TypeError, match="got bool"):
        info.to(True)
    with pytest.raises(ValueError, match="meta"):
        info.to("meta")


def test_accelerate_moves_an_info_with_the_tensors():
    """accelerate's ``send_to_device`` (its ``device_map`` hooks) calls ``.to`` on what has one."""
    operations = pytest.importorskip("accelerate.utils.operations")
    info = fastft.packed_seq_info(seq_lengths=[3, 2])
    kwargs = operations.send_to_device({"info": info, "x": torch.ones(2)}, "cpu")
    assert kwargs["info"] is info


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["position_ids", "seq_lengths"])
def test_info_to_another_device_is_made_once_and_equal(source):
    """From device position ids (the one host sync still pending) and from host lengths: the copy equals
    the original field for field, masks included, and is made once."""
    target = torch.device("cuda", torch.cuda.device_count() - 1)
    lengths = [5, 1, 9, 3]
    if source == "position_ids":
        ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda(0)
        info = fastft.packed_seq_info(position_ids=ids)
    else:
        info = fastft.packed_seq_info(seq_lengths=lengths, device="cuda:0")
    for where in ("cpu", target):
        moved = info.to(where)
        assert moved.to(where) is info.to(where) is moved
        assert moved.device == torch.device(where)
        fields = ("cu_seqlens", "seq_lengths", "max_seqlen", "num_seqs", "doc_ids", "position_ids", "shape")
        for name in fields:
            assert_same(getattr(moved, name), getattr(info, name), path=name)
        assert_same(moved.sdpa_mask(4), info.sdpa_mask(4), path="sdpa_mask")
        assert moved.sdpa_mask(4).device == torch.device(where)
