"""fastft.graphed_checkpoint: CUDA graphs per checkpointed layer against the eager offloaded checkpoint.

Without a GPU the graph mechanics (static buffers shared by layers, copies skipped for unchanged inputs,
padded packing metadata, gradients through autograd, recapture, fallbacks) run with a stand-in graph that
runs its body again on every replay; on a GPU the same tests run with real CUDA graphs.
"""

import types
import warnings

import pytest
import torch

import fastft
from fastft import graphs
from fastft.testing import tiny_hf_model

GPU = torch.cuda.is_available()


class Rerun:
    """A graph stand-in: ``replay()`` runs the captured body again."""

    made = 0

    def __init__(self, body, pool, stream) -> None:
        Rerun.made += 1
        self.body = body

    def replay(self) -> None:
        self.body()


@pytest.fixture(params=["stand-in", pytest.param("cuda", marks=pytest.mark.gpu)])
def where(request, monkeypatch):
    """(device, dtype, counter of captured graphs) for the stand-in on CPU or real graphs on the GPU."""
    counter = {"graphs": 0}
    if request.param == "stand-in":
        monkeypatch.setattr(graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
        make = Rerun
        device, dtype = torch.device("cpu"), torch.float32
    else:
        make = graphs.CudaGraph
        device, dtype = torch.device("cuda"), torch.bfloat16

    def counted(*args):
        counter["graphs"] += 1
        return make(*args)

    monkeypatch.setattr(graphs, "new_graph", counted)
    return device, dtype, counter


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
    # the layers of a signature share their static buffers
    statics = {id(gr.statics) for b in blocks for gr in b.__dict__[graphs._STATE].graphs.values()}
    assert len(statics) == 2


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
    # past MAX_SIGNATURES signatures of a layer
    monkeypatch.setattr(graphs, "MAX_SIGNATURES", 1)
    run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert counter["graphs"] == 4
    with pytest.warns(RuntimeWarning, match="it has had 1 signatures"):
        got = run(blocks, embed, [20, 4, 40], fastft.graphed_checkpoint)  # 3 documents: another bucket
    assert counter["graphs"] == 4
    assert_close(got[0], run(blocks, embed, [20, 4, 40], fastft.offloaded_checkpoint)[0], dtype)


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

    monkeypatch.setattr(graphs, "new_graph", fails)
    blocks, embed = make_stack(torch.device("cpu"), torch.float32, layers=2)
    expected = run(blocks, embed, [30, 34], fastft.offloaded_checkpoint)
    with pytest.warns(RuntimeWarning, match="capturing it failed.*not permitted when stream is capturing"):
        got = run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert_close(got[0], expected[0], torch.float32)
    monkeypatch.setattr(graphs, "new_graph", Rerun)
    made = Rerun.made
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already
        run(blocks, embed, [30, 34], fastft.graphed_checkpoint)
    assert Rerun.made == made  # no second try


def test_errors(monkeypatch):
    monkeypatch.setattr(graphs, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(graphs, "new_graph", Rerun)
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
    with pytest.raises(ValueError, match=r"out must be int32 \[5\]"):
        info.padded(4, 9, out=torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="fill=False needs out"):
        info.padded(4, 9, fill=False)


def test_bucket():
    for limit in (1, 7, 64, 1000):
        for n in range(0, limit + 1):
            b = graphs.bucket(n, limit)
            assert n <= b <= max(limit, n, 1)
            assert b == limit or b == n or b & (b - 1) == 0 and b < 2 * max(n, 1)


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
    with pytest.raises(TypeError, match="graphs must be True or False"):
        ft_hf.apply(model, graphs="yes")
    ft_hf.apply(model, graphs=True)
    layer = ft_hf.hf_model(model).model.layers[0]
    func = layer._gradient_checkpointing_func
    assert func.func is fastft.graphed_checkpoint
    model.gradient_checkpointing_enable()  # what Trainer does: fastft's graphed checkpoint stays
    assert layer._gradient_checkpointing_func.func is fastft.graphed_checkpoint


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
