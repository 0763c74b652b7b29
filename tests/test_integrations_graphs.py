"""``apply(model, graphs=True | "auto")``: the transformers integration's CUDA-graphed decoder layers against
the eager ones (losses, gradients, documents kept apart, few captures over a padding-free stream), with the
stand-in graph of test_graphs.py on CPU and real CUDA graphs on the GPU."""

import functools
import warnings

import pytest
import torch
from test_graphs import assert_close, graphs_on

import fastft
from fastft.graphs import checkpoint as graphs
from fastft.graphs import memory as graph_memory
from fastft.graphs import policy as graph_policy
from fastft.testing import tiny_hf_model

pytest.importorskip("transformers")


@pytest.fixture(params=["stand-in", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request, monkeypatch):
    return graphs_on(request.param, monkeypatch)


@pytest.mark.parametrize("lora", [False, True])
def test_transformers_apply_graphs_matches_eager(where, lora):
    device, dtype, counter = where
    from fastft.integrations import transformers as ft_hf

    def build(graphed):
        model = tiny_hf_model("qwen3", dtype, device)  # one sliding-window layer: same signature
        if lora:
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
        return ft_hf.apply(model, graphs=graphed)

    results = []
    for graphed in (False, True):
        model = build(graphed)
        steps = []
        for seed, lengths in enumerate([[40, 24], [30, 20, 14], [50, 14]]):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, 128, (1, 64), generator=g).to(device)
            positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            steps.append((loss.detach(), grads))
        results.append(steps)
    assert counter["graphs"] == 2 * 2 * 2  # 2 layers x 2 graphs x 2 signatures ([50, 14]: max_seqlen bucket 64)
    for (loss_e, grads_e), (loss_g, grads_g) in zip(*results):
        assert_close(loss_g, loss_e, dtype)
        assert grads_g.keys() == grads_e.keys() and grads_e
        for name in grads_e:
            assert_close(grads_g[name], grads_e[name], dtype)


def test_apply_graphs_errors():
    pytest.importorskip("transformers")
    from fastft.integrations import transformers as ft_hf

    model = tiny_hf_model("llama")
    with pytest.raises(ValueError, match="graphs=True needs offload_checkpointing=True"):
        ft_hf.apply(model, graphs=True, offload_checkpointing=False)
    with pytest.raises(ValueError, match="graphs='auto' needs offload_checkpointing=True"):
        ft_hf.apply(model, graphs="auto", offload_checkpointing=False)
    for bad in ("yes", "Auto", "", 1, 0, None, ["auto"]):  # truthy or falsy, never taken as a bool
        with pytest.raises(TypeError, match=r"graphs must be True, False or 'auto', got"):
            ft_hf.apply(model, graphs=bad)
        with pytest.raises(TypeError, match=r"graphs must be True, False or 'auto', got"):
            ft_hf.enable_gradient_checkpointing(model, graphs=bad)
    ft_hf.apply(model, graphs=True)
    layer = ft_hf.hf_model(model).model.layers[0]
    func = layer._gradient_checkpointing_func
    assert func.func is fastft.graphed_checkpoint and "policy" not in func.keywords
    model.gradient_checkpointing_enable()  # what Trainer does: fastft's graphed checkpoint stays
    assert layer._gradient_checkpointing_func.func is fastft.graphed_checkpoint
    ft_hf.revert(model)
    for enable in (
        functools.partial(ft_hf.apply, graphs="auto"),
        functools.partial(ft_hf.enable_gradient_checkpointing, graphs="auto"),
    ):
        enable(model)
        model.gradient_checkpointing_enable()
        func = layer._gradient_checkpointing_func
        assert func.func is fastft.graphed_checkpoint and func.keywords["policy"] == "auto"
        ft_hf.revert(model)


@pytest.mark.parametrize("launch_bound", [True, False])
def test_apply_graphs_auto(where, monkeypatch, one_thread, launch_bound):
    device, dtype, counter = where
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    # every layer counts as launch-bound (captured after two eager calls) or as GPU-bound (eager for good)
    monkeypatch.setattr(graph_policy, "LAUNCH_BOUND", 0.0 if launch_bound else float("inf"))
    from fastft.integrations import transformers as ft_hf
    from fastft.integrations.transformers.graph_padding import uses_graphs

    models = [ft_hf.apply(tiny_hf_model("qwen3", dtype, device), graphs=option) for option in (False, "auto")]
    layers = ft_hf.decoder_layers(models[1])
    for step, lengths in enumerate([[30, 37], [20, 47], [67], [40, 27]]):  # 67 tokens: bucket 72
        if device.type == "cuda":
            torch.cuda.synchronize()  # the timed call's events are done when the next step reads them
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 128, (1, 67), generator=g).to(device)
        positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        results = []
        for model in models:
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids, position_ids=positions)
            out.loss.backward()
            results.append((out.loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]))
        (loss_e, grads_e), (loss_g, grads_g) = results
        assert_close(loss_g, loss_e, dtype)
        assert len(grads_g) == len(grads_e)
        for a, b in zip(grads_g, grads_e):
            assert_close(a, b, dtype)
    states = [layer.__dict__[graphs._STATE] for layer in layers]
    if launch_bound:  # steps 1-2 eager (the second timed), then captured once, padded to the bucket
        assert counter["graphs"] == 2 * len(layers) and [s.captures for s in states] == [1] * len(layers)
        assert uses_graphs(ft_hf.decoder_stack(models[1]), "auto")
    else:  # decided GPU-bound after the timed call: no capture, and the batches are not padded from then on
        assert counter["graphs"] == 0 and all(s.eager for s in states)
        assert not uses_graphs(ft_hf.decoder_stack(models[1]), "auto")


def test_graphed_documents_never_see_each_other(where):
    device, dtype, counter = where
    from fastft.integrations import transformers as ft_hf

    model = ft_hf.apply(tiny_hf_model("llama", dtype, device), graphs=True)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 128, (n,), generator=g).to(device) for n in (13, 31, 20)]  # 3 padded to 4
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
    packed = model(input_ids=torch.cat(docs)[None], position_ids=positions).logits[0]  # grad on: graphs
    assert counter["graphs"] == 2 * 2
    alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(packed, alone, **tol)


@pytest.fixture
def one_thread():
    """Tiny matrices: one intra-op thread (several only wait for each other on a loaded CI runner)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _stream(g, batches, low, high):
    """Document lengths of ``batches`` padding-free batches of ``low`` to ``high`` tokens."""
    stream = []
    for _ in range(batches):
        tokens = int(torch.randint(low, high + 1, (1,), generator=g))
        cuts = sorted(torch.randperm(tokens - 1, generator=g)[: int(torch.randint(0, 6, (1,), generator=g))] + 1)
        bounds = [0, *[int(c) for c in cuts], tokens]
        stream.append([b - a for a, b in zip(bounds, bounds[1:])])
    return stream


def test_padding_free_stream_few_captures_and_eager_results(where, monkeypatch, one_thread):
    device, dtype, counter = where
    monkeypatch.setenv("FASTFT_BACKEND", "torch")  # the graph mechanics, not the packing kernels: fast on CPU
    from fastft.graphs.buckets import token_bucket
    from fastft.integrations import transformers as ft_hf

    models = [ft_hf.apply(tiny_hf_model("qwen3", dtype, device), graphs=graphed) for graphed in (False, True)]
    layers = ft_hf.decoder_layers(models[1])
    stream = _stream(torch.Generator().manual_seed(4), 30, 33, 64)  # token buckets 36, 40, ..., 64: one octave
    captures = graphs.capture_count()
    signatures = set()  # (pool epoch, token bucket, (sequence-count bound, longest-sequence bound)) the layers saw
    graph_memory.renew(device)  # a fresh pool: the earlier tests' captures do not count as larger ones
    epoch = graph_memory.epoch(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        for seed, lengths in enumerate(stream + stream):  # the second pass: every signature replays
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, 128, (1, sum(lengths)), generator=g).to(device)
            positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
            steps = []
            for model in models:
                model.zero_grad(set_to_none=True)
                out = model(input_ids=ids, labels=ids, position_ids=positions)
                # the fused loss took the head's input: the caller's tokens, padding cut off (its labels' shape)
                assert out.logits is None
                out.loss.backward()
                steps.append(
                    (out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
                )
            (loss_e, grads_e), (loss_g, grads_g) = steps
            assert_close(loss_g, loss_e, dtype)
            assert grads_g.keys() == grads_e.keys() and grads_e
            for name in grads_e:
                assert_close(grads_g[name], grads_e[name], dtype)
            bounds = layers[0].__dict__[graphs._STATE].bounds
            signatures.add((graph_memory.epoch(device), token_bucket(sum(lengths)), bounds))
            if seed == len(stream) - 1:
                first_pass, first_signatures = graphs.capture_count() - captures, set(signatures)
                first_epoch = graph_memory.epoch(device)
    per_layer = [layer.__dict__[graphs._STATE].captures for layer in layers]
    assert graphs.capture_count() - captures == sum(per_layer)
    # the second pass renews nothing and captures only what the first pass captured before its last renewal
    assert graph_memory.epoch(device) == first_epoch
    assert sum(per_layer) - first_pass == len(layers) * len(signatures - first_signatures)
    assert counter["graphs"] == 2 * sum(per_layer)
    # a pool is renewed (every graph dropped) only at a token bucket larger than every one before; one
    # capture per layer, signature and pool; the stated bound: 9 token buckets per octave, per bound pair
    buckets = [token_bucket(sum(lengths)) for lengths in stream]
    renewals = graph_memory.epoch(device) - epoch
    assert renewals == sum(b > max(buckets[:i]) for i, b in enumerate(buckets) if i) <= 8
    bound_pairs = {bounds for _, _, bounds in signatures}
    assert per_layer == [len(signatures)] * len(layers)
    assert len({s[1:] for s in signatures}) <= 9 * len(bound_pairs)
    assert len(set(buckets)) >= 6 and len(bound_pairs) <= 4


def test_padding_tokens_never_reach_real_ones(where, monkeypatch, one_thread):
    device, dtype, counter = where
    monkeypatch.setenv("FASTFT_BACKEND", "torch")
    from fastft.integrations import transformers as ft_hf

    model = ft_hf.apply(tiny_hf_model("llama", dtype, device), graphs=True)
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 128, (n,), generator=g).to(device) for n in (13, 31, 23)]  # 67 tokens: padded to 72
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None].to(device)
    packed = model(input_ids=torch.cat(docs)[None], position_ids=positions).logits[0]
    assert packed.shape[0] == 67 and counter["graphs"] == 2 * 2
    with torch.no_grad():  # eager, unpadded
        alone = torch.cat([model(input_ids=d[None]).logits[0] for d in docs])
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(packed, alone, **tol)
    # the padding's own token ids do not matter: other padding ids, the same real outputs
    from fastft.graphs import buckets

    monkeypatch.setattr(buckets.TokenPadding, "pad", lambda self, t, dim=1, value=0: _pad_with(self, t, dim, 7))
    again = model(input_ids=torch.cat(docs)[None], position_ids=positions).logits[0]
    torch.testing.assert_close(again, packed, **tol)


def _pad_with(pad, t, dim, value):
    shape = list(t.shape)
    shape[dim] = pad.extra
    return torch.cat([t, t.new_full(shape, value)], dim)
