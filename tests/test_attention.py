"""fastft.packed_attention against its reference (fastft/reference/attention.py), against a brute-force
reading of the rules, and against transformers' gpt-oss eager attention (sinks); flash on the GPU."""

import math

import pytest
import torch

import fastft
from fastft.reference import attention as reference

GPU = torch.cuda.is_available()


def random_case(
    g, lengths, batch=1, heads=4, kv_heads=2, dim=16, sinks=False, dtype=torch.float32, device="cpu", v_dim=None
):
    """q, k ``[B, T, H(_kv), D]``, v ``[B, T, H_kv, v_dim or D]``, position ids of ``lengths`` per row, sinks
    ``[H]`` or None."""
    t = sum(lengths)
    q = torch.randn(batch, t, heads, dim, generator=g)
    k = torch.randn(batch, t, kv_heads, dim, generator=g)
    v = torch.randn(batch, t, kv_heads, v_dim or dim, generator=g)
    s = torch.randn(heads, generator=g) if sinks else None
    positions = torch.cat([torch.arange(n) for n in lengths]).repeat(batch, 1)
    to = lambda x: None if x is None else x.to(device, dtype)  # noqa: E731
    return to(q), to(k), to(v), positions.to(device), to(s)


def brute_force(q, k, v, positions, window, sinks, scale):
    """Python loops over one row: the rules, spelled out."""
    t, h, _ = q.shape
    doc = (positions == 0).cumsum(0)
    out = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    for i in range(t):
        keys = [j for j in range(i + 1) if doc[j] == doc[i] and (not window or i - j < window)]
        for head in range(h):
            kv = head // (h // k.shape[1])
            logits = [float(q[i, head].double() @ k[j, kv].double()) * scale for j in keys]
            extra = [float(sinks[head])] if sinks is not None else []
            m = max(logits + extra)
            z = sum(math.exp(x - m) for x in logits + extra)
            for j, x in zip(keys, logits):
                out[i, head] += math.exp(x - m) / z * v[j, kv].double()
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_reference_matches_the_rules(window, sinks, rng):
    q, k, v, positions, s = random_case(rng, [4, 1, 6], heads=4, kv_heads=2, dim=8, sinks=sinks)
    doc = fastft.packed_seq_info(position_ids=positions, backend="torch").doc_ids
    got = reference.packed_attention(q, k, v, doc, window or 0, s, 0.3)
    want = brute_force(q[0], k[0], v[0], positions[0], window, s, 0.3)
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)


def grads(fn, *inputs):
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype))
    return [out.detach()] + [None if x is None else x.grad for x in leaves]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True])
def test_dense_path_matches_reference_with_gradients(batch, window, sinks, rng):
    lengths = torch.randint(1, 12, (4,), generator=rng).tolist()
    q, k, v, positions, s = random_case(rng, lengths, batch=batch, sinks=sinks)
    info = fastft.packed_seq_info(position_ids=positions)
    doc = info.doc_ids
    got = grads(lambda *t: fastft.packed_attention(*t[:3], info, window=window, sinks=t[3], impl="dense"), q, k, v, s)
    want = grads(lambda *t: reference.packed_attention(*t[:3], doc, window or 0, t[3], 16**-0.5), q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("v_dim", [8, 24])
@pytest.mark.parametrize("sinks", [False, True])
def test_values_with_their_own_head_dim(v_dim, sinks, rng):
    """MLA layers (DeepSeek-V3, Kimi-Linear): values of another head dim than queries and keys; the output has
    the values' head dim. The reference against the rules, the dense path against the reference."""
    lengths = torch.randint(1, 9, (3,), generator=rng).tolist()
    q, k, v, positions, s = random_case(rng, lengths, v_dim=v_dim, sinks=sinks)
    info = fastft.packed_seq_info(position_ids=positions)
    want = brute_force(q[0], k[0], v[0], positions[0], None, s, 0.3)
    got = reference.packed_attention(q, k, v, info.doc_ids, 0, s, 0.3)[0].double()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = grads(lambda *t: fastft.packed_attention(*t[:3], info, sinks=t[3], scale=0.3), q, k, v, s)
    ref = grads(lambda *t: reference.packed_attention(*t[:3], info.doc_ids, 0, t[3], 0.3), q, k, v, s)
    assert got[0].shape == (*q.shape[:3], v_dim)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("v_dim", [8, 24])
def test_flash_path_pads_to_one_head_dim(v_dim, monkeypatch, rng):
    """The flash kernels take one head dim: q/k or v are zero-padded to the larger and the output cut back.
    Checked on any device with the kernel replaced by the reference over the flattened stream (which asserts
    the one head dim); the kernel itself on a GPU below."""
    from fastft import attention

    def kernel(q, k, v, cu_seqlens, max_seqlen, scale, window, sinks):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] == max(16, v_dim)
        doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().cpu())
        return reference.packed_attention(q[None], k[None], v[None], doc[None], window or 0, sinks, scale)[0]

    monkeypatch.setattr(attention, "flash_reason", lambda *args: None)
    monkeypatch.setattr(attention, "flash_op", kernel)
    q, k, v, positions, _ = random_case(rng, [3, 6, 2], batch=2, v_dim=v_dim)
    info = fastft.packed_seq_info(position_ids=positions)
    got = grads(lambda *t: fastft.packed_attention(*t, info, impl="flash"), q, k, v)
    want = grads(lambda *t: reference.packed_attention(*t, info.doc_ids, 0, None, 16**-0.5), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_unbatched_and_flattened_layouts(rng):
    q, k, v, positions, _ = random_case(rng, [3, 5, 2], batch=1)
    info = fastft.packed_seq_info(position_ids=positions[0])  # [T] position ids
    out = fastft.packed_attention(q[0], k[0], v[0], info)  # [T, H, D]
    torch.testing.assert_close(out, fastft.packed_attention(q, k, v, fastft.packed_seq_info(position_ids=positions))[0])
    # Lengths over the flattened stream: a document may cross the row boundary of q's [B, T] layout.
    q2, k2, v2 = (x.reshape(2, 5, *x.shape[2:]) for x in (q, k, v))
    info = fastft.packed_seq_info(seq_lengths=[3, 5, 2])
    got = fastft.packed_attention(q2, k2, v2, info, impl="dense")
    torch.testing.assert_close(got.reshape(1, 10, *got.shape[2:]), out[None], atol=1e-6, rtol=1e-6)


def test_autocast_casts_inputs_like_sdpa(rng):
    """Mixed precision hands attention fp32 rotated q/k beside a bf16 v: under autocast the op computes in
    autocast's dtype (as SDPA does); outside it, mixed dtypes are a TypeError."""
    device = "cuda" if GPU else "cpu"
    q, k, v, positions, sinks = random_case(rng, [4, 7, 5], sinks=True, device=device)
    info = fastft.packed_seq_info(position_ids=positions)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = fastft.packed_attention(q, k, v.bfloat16(), info, sinks=sinks)
        with torch.autocast(device, enabled=False):
            with pytest.raises(TypeError, match="share a dtype"):
                fastft.packed_attention(q, k, v.bfloat16(), info)
    want = fastft.packed_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), info, sinks=sinks)
    assert got.dtype == torch.bfloat16
    # autocast also runs the dense path's ops in bf16, rounding in other places than the cast-first call: the
    # outputs (|x| < 4) may differ by two bf16 steps (0.0156 each in [2, 4))
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


def test_matches_transformers_gpt_oss_eager_attention(rng):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers.models.gpt_oss import modeling_gpt_oss

    q, k, v, positions, s = random_case(rng, [1, 7, 12], heads=8, kv_heads=2, dim=16, sinks=True)
    info = fastft.packed_seq_info(position_ids=positions)
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.sinks = 4, s
    for window in (None, 4):
        mask = info.sdpa_mask(window=window, dtype=torch.float32)
        want = modeling_gpt_oss.eager_attention_forward(module, *(x.transpose(1, 2) for x in (q, k, v)), mask, 0.125)[0]
        got = fastft.packed_attention(q, k, v, info, window=window, sinks=s, scale=0.125)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bad_input():
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    info = fastft.packed_seq_info(seq_lengths=[2, 4])
    cases = [
        ((q.tolist(), k, v, info), {}, TypeError, "q must be a tensor"),
        ((q.long(), k, v, info), {}, TypeError, "q must be floating point"),
        ((q[0, 0], k, v, info), {}, ValueError, r"q must be \[B, T, H, D\] or \[T, H, D\]"),
        ((q, k[:, :5], v, info), {}, ValueError, "k must be .* and v"),
        ((q, k, v[:, :5], info), {}, ValueError, "k must be .* and v"),
        ((q, k, torch.randn(1, 6, 4, 8), info), {}, ValueError, "v .*matching k's tokens and heads"),
        ((q, torch.randn(1, 6, 3, 8), torch.randn(1, 6, 3, 8), info), {}, ValueError, "multiple of k/v's 3"),
        ((q, k.double(), v.double(), info), {}, TypeError, "share a dtype"),
        ((q, k, v, "info"), {}, TypeError, "info must be a PackedSeqInfo"),
        ((q, k, v, fastft.packed_seq_info(seq_lengths=[7])), {}, ValueError, "info describes 7 tokens, q has 6"),
        ((q, k, v, info), {"window": 2.0}, TypeError, "window must be an int"),
        ((q, k, v, info), {"sinks": torch.zeros(3)}, ValueError, r"sinks must be \[H=4\]"),
        ((q, k, v, info), {"sinks": torch.zeros(4, dtype=torch.long)}, TypeError, "sinks must be a floating tensor"),
        ((q, k, v, info), {"scale": "x"}, TypeError, "scale must be a number"),
        ((q, k, v, info), {"scale": float("nan")}, ValueError, "scale must be finite"),
        ((q, k, v, info), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
        ((q, k, v, info), {"impl": "triton"}, ValueError, "impl must be one of"),
        ((q[..., :0], k[..., :0], v[..., :0], info), {}, ValueError, "head dims >= 1, got"),
        ((q, k, v[..., :0], info), {}, ValueError, "head dims >= 1, got"),
        ((q.to("meta"), k, v, info), {}, ValueError, "q must hold data .* got a meta tensor"),
        ((q, k, v.to("meta"), info), {}, ValueError, "v must hold data .* got a meta tensor"),
    ]
    if not GPU:
        cases.append(
            ((q, k, v, info), {"impl": "flash"}, ValueError, "impl='flash' cannot run this call: it needs CUDA")
        )
    for args, kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            fastft.packed_attention(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("sinks", [False, True])
def test_flash_path_matches_reference_on_gpu(window, sinks, rng):
    lengths = [1, 23, 9, 47, 128, 3]
    q, k, v, positions, s = random_case(rng, lengths, batch=2, heads=8, kv_heads=2, dim=64, sinks=sinks, device="cuda")
    info = fastft.packed_seq_info(position_ids=positions)
    bf16 = [None if x is None else x.bfloat16() for x in (q, k, v, s)]
    got = grads(lambda *t: fastft.packed_attention(*t[:3], info, window=window, sinks=t[3], impl="flash"), *bf16)
    want = grads(lambda *t: reference.packed_attention(*t[:3], info.doc_ids, window or 0, t[3], 0.125), q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        if b is not None:
            torch.testing.assert_close(a.float(), b, atol=2e-2 * float(b.abs().max()), rtol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("v_dim", [32, 128])
def test_flash_path_with_another_value_head_dim_on_gpu(v_dim, rng):
    q, k, v, positions, _ = random_case(rng, [1, 23, 9, 47], heads=8, kv_heads=2, dim=64, v_dim=v_dim, device="cuda")
    info = fastft.packed_seq_info(position_ids=positions)
    got = grads(lambda *t: fastft.packed_attention(*t, info, impl="flash"), *(x.bfloat16() for x in (q, k, v)))
    want = grads(lambda *t: reference.packed_attention(*t, info.doc_ids, 0, None, 0.125), q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.float(), b, atol=2e-2 * float(b.abs().max()), rtol=2e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 8])
def test_flash_sinks_match_gpt_oss_eager_on_gpu(window, rng):
    modeling_gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

    q, k, v, positions, s = random_case(rng, [1, 23, 9, 47], heads=8, kv_heads=2, dim=64, sinks=True, device="cuda")
    info = fastft.packed_seq_info(position_ids=positions)
    module = torch.nn.Module().eval()
    module.num_key_value_groups = 4

    def eager(q_, k_, v_, s_):  # transformers' gpt-oss attention, fp32, with the fastft document mask
        module.sinks = s_
        mask = info.sdpa_mask(window=window, dtype=torch.float32)
        return modeling_gpt_oss.eager_attention_forward(
            module, *(x.transpose(1, 2) for x in (q_, k_, v_)), mask, 0.125
        )[0]

    bf16 = [x.bfloat16() for x in (q, k, v, s)]
    got = grads(
        lambda *t: fastft.packed_attention(*t[:3], info, window=window, sinks=t[3], scale=0.125, impl="flash"), *bf16
    )
    want = grads(eager, q, k, v, s)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a.float(), b, atol=2e-2 * float(b.abs().max()), rtol=2e-2, msg=name)
