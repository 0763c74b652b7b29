"""fastft.graphed_checkpoint: CUDA graphs per checkpointed layer against the eager offloaded checkpoint.

Without a GPU the graph mechanics (static buffers shared by layers, copies skipped for unchanged inputs,
padded packing metadata, gradients through autograd, recapture, fallbacks) run with a stand-in graph that
runs its body again on every replay; on a GPU the same tests run with real CUDA graphs.
"""

import functools
import gc
import types
import warnings

import pytest
import torch

import fastft
from fastft.graphs import capture as graph_capture
from fastft.graphs import checkpoint as graphs
from fastft.graphs import memory as graph_memory
from fastft.graphs import policy as graph_policy

GPU = torch.cuda.is_available()


class Rerun:
    """A graph stand-in: ``replay()`` runs the captured body again."""

    made = 0

    def __init__(self, body, pool, stream) -> None:
        Rerun.made += 1
        self.body = body

    def replay(self) -> None:
        self.body()


def graphs_on(where: str, monkeypatch):
    """(device, dtype, counter of captured graphs) for ``where``: the stand-in on CPU (``"stand-in"``) or real
    graphs on the GPU (``"cuda"``)."""
    counter = {"graphs": 0}
    if where == "stand-in":
        monkeypatch.setattr(graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
        make = Rerun
        device, dtype = torch.device("cpu"), torch.float32
    else:
        make = graph_capture.CudaGraph
        device, dtype = torch.device("cuda"), torch.bfloat16

    def counted(*args):
        counter["graphs"] += 1
        return make(*args)

    monkeypatch.setattr(graph_capture, "new_graph", counted)
    return device, dtype, counter


@pytest.fixture(params=["stand-in", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request, monkeypatch):
    return graphs_on(request.param, monkeypatch)


class Block(torch.nn.Module):
    """A decoder-like layer: frozen projection + low-rank trainable update, packed attention over ``info``,
    a shared ``rotary`` tensor, a trainable output projection and a residual."""

    def __init__(self, dim, heads, g) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False).requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(4, dim, generator=g) * 0.2)
        self.lora_b = torch.nn.Parameter(torch.randn(3 * dim, 4, generator=g) * 0.2)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, *, info, rotary, scale=1.0, tags=None):
        t, d = x.shape
        qkv = self.qkv(x) + (x @ self.lora_a.T) @ self.lora_b.T
        q, k, v = qkv.view(t, 3, self.heads, d // self.heads).unbind(1)
        out = fastft.packed_attention(q * rotary, k * rotary, v, info)
        return x + scale * self.out(out.reshape(t, d))


def make_stack(device, dtype, layers=3, dim=64, heads=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.nn.ModuleList(Block(dim, heads, g) for _ in range(layers))
    embed = torch.nn.Parameter(torch.randn(16, dim, generator=g))
    return blocks.to(device, dtype), embed.data.to(device, dtype).requires_grad_()


def run(blocks, embed, lengths, checkpoint, seed=1, **kwargs):
    """Loss and every gradient of one step over documents of ``lengths``."""
    device, dtype = embed.device, embed.dtype
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    info = fastft.packed_seq_info(seq_lengths=lengths, device=device)
    rotary = (1 + 0.1 * torch.randn(tokens, 1, embed.shape[1] // blocks[0].heads, generator=g)).to(device, dtype)
    x = embed[torch.randint(0, 16, (tokens,), generator=g).to(device)]
    for block in blocks:
        x = checkpoint(block, x, info=info, rotary=rotary, **kwargs)
    loss = (x.float() ** 2).mean()
    for p in [embed, *blocks.parameters()]:
        p.grad = None
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in [embed, *blocks.parameters()] if p.grad is not None]


def assert_close(a, b, dtype):
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(a, b, **tol)
    if dtype != torch.float32 and b.float().norm() > 0:  # bf16's atol is near tiny gradients: bound the norm too
        assert float((a.float() - b.float()).norm() / b.float().norm()) <= 0.1


def test_matches_offloaded_checkpoint_and_reuses_graphs(where):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype)
    batches = [[20, 30, 14], [10, 25, 29], [40, 10, 5, 9], [7, 11, 13, 33]]  # 3rd: a bigger max_seqlen bucket
    for step, lengths in enumerate(batches):
        expected = run(blocks, embed, lengths, fastft.offloaded_checkpoint, seed=step)
        got = run(blocks, embed, lengths, fastft.graphed_checkpoint, seed=step)
        assert_close(got[0], expected[0], dtype)
        assert len(got[1]) == len(expected[1]) == 1 + 3 * 4  # embed, and per block lora_a, lora_b, out w, b
        for a, b in zip(got[1], expected[1]):
            assert_close(a, b, dtype)
    # two graphs per layer and signature: batches 1-2 share one, 3 has its own, 4 is batch 3's again
    assert counter["graphs"] == 2 * 3 * 2
    # the layers of a signature share their static buffers, and the signatures share their storage
    statics = {gr.statics for b in blocks for gr in b.__dict__[graphs._STATE].graphs.values()}
    assert len(statics) == 2
    assert len({st.inputs[0].data_ptr() for st in statics}) == len({st.out[0].data_ptr() for st in statics}) == 1
    assert all(st.grad_in[0].data_ptr() == st.out[0].data_ptr() for st in statics)  # each copied out at once


def test_static_buffers_and_pool_go_with_the_last_graphed_layer(where):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype)
    run(blocks, embed, [20, 30, 14], fastft.graphed_checkpoint)
    assert counter["graphs"] and graph_memory.static_bytes() > 0
    other, other_embed = make_stack(device, dtype, seed=1)
    run(other, other_embed, [10, 9], fastft.graphed_checkpoint)
    del blocks
    gc.collect()
    assert graph_memory.static_bytes() > 0  # the other model's layers still replay from them
    del other
    gc.collect()
    assert graph_memory.static_bytes() == 0 and not graph_memory._pools
    blocks, embed = make_stack(device, dtype)  # a new model starts afresh
    run(blocks, embed, [20, 30, 14], fastft.graphed_checkpoint)
    assert graph_memory.static_bytes() > 0


def test_parameters_replaced_or_frozen_after_capture(where):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype, layers=2)
    run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 4
    blocks[0].out.weight = torch.nn.Parameter(blocks[0].out.weight.detach() * 2)  # new storage
    blocks[1].lora_a.requires_grad_(False)
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 8  # both layers captured again
    assert len(got[1]) == len(expected[1]) == 1 + 4 + 3
    assert_close(got[0], expected[0], dtype)
    for a, b in zip(got[1], expected[1]):
        assert_close(a, b, dtype)


def test_fallbacks_warn_once_and_stay_correct(where, monkeypatch):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype, layers=2)
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    # an unhashable argument: no signature, the eager checkpoint runs
    with pytest.warns(RuntimeWarning, match=r"neither a tensor, a PackedSeqInfo nor hashable \(SimpleNamespace\)"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint, tags=types.SimpleNamespace(a=1))
    assert counter["graphs"] == 0
    assert_close(got[0], expected[0], dtype)
    # past MAX_SIGNATURES signatures of a layer the least-used graphs are dropped, nothing runs eagerly
    monkeypatch.setattr(graphs, "MAX_SIGNATURES", 1)
    run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 4
    captures = graphs.capture_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = run(blocks, embed, [20, 4, 40], fastft.graphed_checkpoint)  # 3 documents: another bound
        again = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)  # bounds only grow: the same one
    assert counter["graphs"] == 8 and graphs.capture_count() == captures + 2
    assert all(len(b.__dict__[graphs._STATE].graphs) == 1 for b in blocks)
    assert_close(got[0], run(blocks, embed, [20, 4, 40], fastft.offloaded_checkpoint)[0], dtype)
    assert_close(again[0], expected[0], dtype)


def test_layers_with_hooks_run_eagerly(where):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype, layers=2)
    seen = []
    handle = blocks[1].out.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    seen.clear()
    with pytest.warns(RuntimeWarning, match="has forward or backward hooks, which a replay would not run"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 2  # the first layer only
    assert seen  # the eager checkpoint ran the hook
    assert_close(got[0], expected[0], dtype)
    for a, b in zip(got[1], expected[1]):
        assert_close(a, b, dtype)
    handle.remove()
    run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 4


class InPlaceBlock(Block):
    def forward(self, x, **kwargs):
        kwargs["rotary"].mul_(1.0)  # in place on an argument: a replay would change the static copy
        return super().forward(x, **kwargs)


def test_a_layer_that_modifies_its_arguments_runs_eagerly(where):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype, layers=2)
    blocks[0].__class__ = InPlaceBlock
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    with pytest.warns(RuntimeWarning, match="InPlaceBlock runs without.*modifies its tensor arguments in place"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 2  # the second layer only
    assert_close(got[0], expected[0], dtype)
    for a, b in zip(got[1], expected[1]):
        assert_close(a, b, dtype)


class SyncBlock(Block):
    def forward(self, x, **kwargs):
        if not torch.isfinite(x.sum()).item():  # a host sync: no graph can hold it
            raise AssertionError("not finite")
        return super().forward(x, **kwargs)


@pytest.mark.gpu
def test_a_layer_that_syncs_falls_back_and_the_others_still_capture(monkeypatch):
    blocks, embed = make_stack(torch.device("cuda"), torch.bfloat16, layers=3)
    blocks[1].__class__ = SyncBlock
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    with pytest.warns(RuntimeWarning, match="SyncBlock runs without CUDA graphs.*capturing it failed"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert_close(got[0], expected[0], torch.bfloat16)
    for a, b in zip(got[1], expected[1]):
        assert_close(a, b, torch.bfloat16)
    state = [b.__dict__[graphs._STATE] for b in blocks]
    assert state[1].off and not state[0].off and not state[2].off
    assert len(state[0].graphs) == len(state[2].graphs) == 1  # captured before and after the failed one


class DetachedBlock(Block):
    def forward(self, x, **kwargs):
        return super().forward(x, **kwargs).detach()  # trainable parameters, but no gradient flows out


def test_a_layer_whose_outputs_carry_no_gradient_runs_eagerly(where):
    device, dtype, counter = where
    block = DetachedBlock(64, 4, torch.Generator().manual_seed(0)).to(device, dtype)
    x = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
    info = fastft.packed_seq_info(seq_lengths=[30, 34], device=device)
    rotary = torch.ones(64, 1, 16, device=device, dtype=dtype)
    with pytest.warns(RuntimeWarning, match="no output of it carries a gradient"):
        y = fastft.graphed_checkpoint(block, x, info=info, rotary=rotary)
    assert counter["graphs"] == 0 and not y.requires_grad
    torch.testing.assert_close(y, block(x, info=info, rotary=rotary))


def test_capture_failure_falls_back_for_good(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_DEVICES", ("cuda", "cpu"))

    def fails(body, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(graph_capture, "new_graph", fails)
    blocks, embed = make_stack(torch.device("cpu"), torch.float32, layers=2)
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    with pytest.warns(RuntimeWarning, match="capturing it failed.*not permitted when stream is capturing"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert_close(got[0], expected[0], torch.float32)
    monkeypatch.setattr(graph_capture, "new_graph", Rerun)
    made = Rerun.made
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert Rerun.made == made  # no second try


def test_errors(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(graph_capture, "new_graph", Rerun)
    blocks, embed = make_stack(torch.device("cpu"), torch.float32, layers=1)
    x = torch.randn(8, 64, requires_grad=True)
    with pytest.raises(TypeError, match="needs a module call"):
        fastft.graphed_checkpoint(lambda t: t * 2, x)
    with pytest.raises(ValueError, match="use_reentrant"):
        fastft.graphed_checkpoint(blocks[0], x, use_reentrant=True)
    with pytest.raises(TypeError, match="offload_config"):
        fastft.graphed_checkpoint(blocks[0], x, offload_config={"enabled": True})
    dropout = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.1)).train()
    with pytest.raises(ValueError, match="draws random numbers"):
        fastft.graphed_checkpoint(dropout, x)
    # no grad, or nothing that needs one: the function just runs
    with torch.no_grad():
        assert torch.equal(fastft.graphed_checkpoint(dropout.eval(), x), dropout(x))


def test_padded_info(rng):
    lengths = [5, 1, 9, 3]
    info = fastft.packed_seq_info(seq_lengths=lengths)
    padded = info.padded(8, 16)
    assert padded.cu_seqlens.tolist() == [0, 5, 6, 15, 18, 18, 18, 18, 18]
    assert padded.seq_lengths.tolist() == lengths + [0] * 4
    assert (padded.num_seqs, padded.max_seqlen, padded.num_tokens) == (8, 16, 18)
    assert torch.equal(padded.doc_ids, info.doc_ids) and torch.equal(padded.position_ids, info.position_ids)
    assert torch.equal(padded.sdpa_mask(window=3), info.sdpa_mask(window=3))
    q, k, v = (torch.randn(18, 2, 8, generator=rng) for _ in range(3))
    torch.testing.assert_close(fastft.packed_attention(q, k, v, padded), fastft.packed_attention(q, k, v, info))
    out = torch.zeros(9, dtype=torch.int32)
    view = info.padded(8, 9, out=out)
    assert view.cu_seqlens is out and out.tolist() == padded.cu_seqlens.tolist()
    out.zero_()
    assert info.padded(8, 9, out=out, fill=False).cu_seqlens.tolist() == [0] * 9  # no kernel ran
    with pytest.raises(ValueError, match="num_seqs=3 is less than"):
        info.padded(3, 16)
    with pytest.raises(ValueError, match="max_seqlen=8 must be from the longest sequence"):
        info.padded(4, 8)
    with pytest.raises(ValueError, match="max_seqlen=19 must be"):
        info.padded(4, 19)
    with pytest.raises(ValueError, match=r"out must be a contiguous int32 \[5\]"):
        info.padded(4, 9, out=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="fill=False needs out"):
        info.padded(4, 9, fill=False)


def test_auto_policy_graphs_launch_bound_layers_only(where, monkeypatch):
    device, dtype, counter = where
    blocks, embed = make_stack(device, dtype, layers=2)
    auto = functools.partial(fastft.graphed_checkpoint, policy="auto")
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    monkeypatch.setattr(graph_policy, "LAUNCH_BOUND", float("inf"))  # every layer counts as GPU-bound
    for _ in range(4):
        got = run(blocks, embed, [30, 34], auto)
        assert_close(got[0], expected[0], dtype)
    assert counter["graphs"] == 0 and all(b.__dict__[graphs._STATE].eager for b in blocks)
    blocks, embed = make_stack(device, dtype, layers=2)
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    monkeypatch.setattr(graph_policy, "LAUNCH_BOUND", 0.0)  # every layer counts as launch-bound
    for step in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize()  # the timed call's events are done when the next step reads them
        got = run(blocks, embed, [30, 34], auto)
        assert_close(got[0], expected[0], dtype)
        for a, b in zip(got[1], expected[1]):
            assert_close(a, b, dtype)
        # the first call of a layer runs eagerly, the second is timed, the third captures
        assert counter["graphs"] == (2 * 2 if step >= 2 else 0), (step, counter["graphs"])
    with pytest.raises(ValueError, match="policy must be one of"):
        fastft.graphed_checkpoint(blocks[0], embed[:4], policy="sometimes")


def test_auto_policy_like_layers_decide_together(where, monkeypatch):
    """Layers of one kind timed together decide on their summed times, not each on its own: one layer timed
    GPU-bound beside launch-bound ones is graphed with them (an eager one would hold its working set beside the
    graph pool's). A stack built later times and decides afresh; layers of another shape decide apart."""
    device, dtype, counter = where
    times = []  # (host ms, GPU ms) each timed call takes, in call order

    class Timed(graph_policy.Probe):
        def __init__(self, device):
            self.host_ms, self.gpu = times.pop(0)

        def stop(self):
            pass

        def gpu_ms(self):
            return self.gpu

    monkeypatch.setattr(graph_policy, "Probe", Timed)
    auto = functools.partial(fastft.graphed_checkpoint, policy="auto")

    def decisions(blocks):
        return [b.__dict__[graphs._STATE].eager for b in blocks]

    blocks, embed = make_stack(device, dtype, layers=3)
    times += [(1.0, 10.0), (30.0, 10.0), (20.0, 10.0)]  # alone, the first would be GPU-bound: 0.1 < 0.7
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    for _ in range(3):
        got = run(blocks, embed, [30, 34], auto)
        assert_close(got[0], expected[0], dtype)
    assert decisions(blocks) == [False] * 3 and counter["graphs"] == 2 * 3

    later, embed = make_stack(device, dtype, layers=2, seed=1)  # the same kind, a new stack: its own times
    times += [(1.0, 10.0), (2.0, 10.0)]
    for _ in range(3):
        run(later, embed, [30, 34], auto)
    assert decisions(later) == [True, True] and counter["graphs"] == 2 * 3

    wide, wide_embed = make_stack(device, dtype, layers=1, dim=32, heads=2)  # another kind, timed beside
    mixed, _ = make_stack(device, dtype, layers=1, seed=2)
    times += [(1.0, 10.0), (30.0, 10.0)]  # mixed (GPU-bound), then wide (launch-bound)
    for _ in range(3):
        run(mixed, embed, [30, 34], auto)
        run(wide, wide_embed, [8], auto)
    assert decisions(mixed) == [True] and decisions(wide) == [False] and counter["graphs"] == 2 * 3 + 2
    assert not times


def test_auto_policy_gives_up_on_ever_new_signatures(where, monkeypatch):
    device, dtype, counter = where
    monkeypatch.setattr(graph_policy, "LAUNCH_BOUND", 0.0)
    monkeypatch.setattr(graphs, "MAX_SIGNATURES", 2)
    blocks, embed = make_stack(device, dtype, layers=1, dim=32, heads=2)
    auto = functools.partial(fastft.graphed_checkpoint, policy="auto")
    run(blocks, embed, [8], auto)  # eager
    run(blocks, embed, [8], auto)  # timed
    if device.type == "cuda":
        torch.cuda.synchronize()  # the timing is read at the next call
    with pytest.warns(RuntimeWarning, match="its signatures keep changing"):
        for tokens in range(9, 14):  # a new token count every call
            got = run(blocks, embed, [tokens], auto)
    assert blocks[0].__dict__[graphs._STATE].captures == 2
    assert_close(got[0], run(blocks, embed, [13], fastft.offloaded_checkpoint)[0], dtype)


def test_a_dropped_models_graphs_are_not_collected_inside_a_capture(where, monkeypatch):
    """A dropped model whose graphs sit in a reference cycle: a garbage collection inside another layer's
    capture would destroy them there, which CUDA refuses (the capture fails, the layer runs eagerly for good).
    Captures run with the collector paused; here it is asked to collect at every allocation."""
    device, dtype, counter = where
    paused = []
    make = graph_capture.new_graph

    def watched(body, pool, stream):
        paused.append(not gc.isenabled())
        threshold = gc.get_threshold()
        gc.set_threshold(1, 1, 1)  # a full collection at about every allocation the capture makes
        try:
            return make(body, pool, stream)
        finally:
            gc.set_threshold(*threshold)

    old, old_embed = make_stack(device, dtype, layers=2, seed=1)
    run(old, old_embed, [20, 12], fastft.graphed_checkpoint)
    old.cycle = [old]  # only the cyclic collector can free it
    del old
    monkeypatch.setattr(graph_capture, "new_graph", watched)
    blocks, embed = make_stack(device, dtype, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns and runs eagerly
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 2 * 2 + 2 * 2 and paused == [True] * 4 and gc.isenabled()
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    assert_close(got[0], expected[0], dtype)


def test_growing_buffers_drop_every_graph(where, monkeypatch):
    device, dtype, counter = where
    monkeypatch.setattr(graph_memory, "EXACT_BYTES", 0)  # every buffer shared and sized to a power of two
    blocks, embed = make_stack(device, dtype, layers=2)
    states = [b.__dict__ for b in blocks]
    run(blocks, embed, [30, 34], fastft.graphed_checkpoint)  # 64 tokens
    run(blocks, embed, [20, 20], fastft.graphed_checkpoint)  # 40 tokens: in the same buffers
    assert counter["graphs"] == 8 and all(len(st[graphs._STATE].graphs) == 2 for st in states)
    epoch = graph_memory.epoch(device)
    got = run(blocks, embed, [50, 50], fastft.graphed_checkpoint)  # 100 tokens: the buffers grow
    assert graph_memory.epoch(device) > epoch and counter["graphs"] == 12
    assert all(len(st[graphs._STATE].graphs) == 1 for st in states)  # the others were dropped
    expected = run(blocks, embed, [50, 50], fastft.offloaded_checkpoint)
    for a, b in zip(got[1], expected[1]):
        assert_close(a, b, dtype)
    got = run(blocks, embed, [20, 20], fastft.graphed_checkpoint)  # captured again, in the grown buffers
    assert counter["graphs"] == 16
    assert_close(got[0], run(blocks, embed, [20, 20], fastft.offloaded_checkpoint)[0], dtype)
