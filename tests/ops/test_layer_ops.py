"""The small ops of the K3 layers against their written-out formulas: SiTU, norms, short conv, AttnRes mix,
MLA attention, router and sampling."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.ops import (
    attn_res_mix,
    causal_attention,
    causal_attention_ref,
    gated_rms_norm,
    l2_norm,
    rms_norm,
    route_topk,
    router_scores,
    sample,
    short_conv,
    short_conv_ref,
    situ_glu,
)  # fmt: skip
from openk3.ops.attention.mla import absorbed_weights, mla_decode, mla_decode_ref
from openk3.ops.conv import roll_tail, short_conv_few, short_conv_varlen
from openk3.utils import rel_rms


def test_situ_spec_vectors():
    a = torch.tensor([-3.0, 0.0, 1.0, 5.0, 50.0], dtype=torch.float64)
    b = torch.ones_like(a)
    gate = situ_glu(a, b) / (25.0 * torch.tanh(b / 25.0))  # divide out the up factor
    assert torch.allclose(gate, torch.tensor([-0.120490, 0.0, 0.716200, 3.370425, 4.0], dtype=torch.float64), atol=1e-6)
    up = situ_glu(torch.full((3,), 1e3, dtype=torch.float64), torch.tensor([1.0, 30.0, -100.0], dtype=torch.float64))
    assert torch.allclose(up / 4.0, torch.tensor([0.999467, 20.841365, -24.983232], dtype=torch.float64), atol=1e-6)
    both = situ_glu(torch.tensor([5.0], dtype=torch.float64), torch.tensor([30.0], dtype=torch.float64))
    assert abs(both.item() - 70.244254) < 1e-5


def test_situ_gradient_matches_spec_formula():
    a = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    b = torch.ones(1, dtype=torch.float64)
    gate = situ_glu(a, b) / (25.0 * torch.tanh(b / 25.0))
    gate.backward()
    assert abs(a.grad.item() - 0.87982165) < 1e-7
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    y = torch.randn(64, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, q: situ_glu(p * 5, q * 40), (x, y))


def test_situ_is_bounded_and_rounds_once():
    a = torch.randn(1000) * 100
    b = torch.randn(1000) * 100
    assert situ_glu(a, b).abs().max() <= 100  # < 100 exactly; fp32 rounds the saturated product to 100
    bf = situ_glu(a.bfloat16(), b.bfloat16())
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, situ_glu(a.bfloat16().float(), b.bfloat16().float()).bfloat16())


def test_rms_norm_casts_before_the_weight_multiply():
    x = torch.randn(4, 64).bfloat16()
    w = (1 + torch.randn(64) * 0.1).bfloat16()
    out = rms_norm(x, w, 1e-5)
    x32 = x.float()
    normed = (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(out, w * normed)
    # fp32 path is the plain formula
    x = torch.randn(4, 64)
    w = torch.randn(64)
    assert rel_rms(rms_norm(x, w, 1e-6), w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) < 1e-6


def test_gated_and_l2_norms():
    x, gate, w = torch.randn(3, 2, 32), torch.randn(3, 2, 32), torch.randn(32)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w * torch.sigmoid(gate)
    assert rel_rms(gated_rms_norm(x, gate, w, 1e-5), ref) < 1e-6
    assert gated_rms_norm(x.bfloat16(), gate.bfloat16(), w, 1e-5).dtype == torch.bfloat16
    assert rel_rms(l2_norm(x), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)) < 1e-6
    assert torch.isfinite(l2_norm(torch.zeros(2, 8))).all()  # eps inside the sqrt keeps zero rows finite


@pytest.mark.parametrize("T", [1, 2, 3, 5, 17])
def test_short_conv_matches_token_loop_and_continues_from_tail(T):
    x = torch.randn(2, T, 12)
    w = torch.randn(12, 1, 4)
    y, tail = short_conv(x, w)
    for n in range(2):
        assert rel_rms(y[n], short_conv_ref(x[n], w)) < 1e-6
    # Split the sequence anywhere and carry the tail: same outputs.
    for cut in range(T + 1):
        y1, t1 = short_conv(x[:, :cut], w)
        y2, t2 = short_conv(x[:, cut:], w, t1)
        assert torch.allclose(torch.cat([y1, y2], 1), y, atol=1e-6)
        assert torch.equal(t2, tail)


def test_attn_res_properties():
    bank = [torch.randn(5, 16) for _ in range(3)]
    P = torch.randn(5, 16)
    gamma = torch.randn(16)
    mean = attn_res_mix(bank, P, gamma, torch.zeros(1, 16), 1e-5)  # w = 0: plain mean of the sources
    assert rel_rms(mean, torch.stack([*bank, P]).mean(0)) < 1e-6
    assert torch.equal(attn_res_mix([], P, gamma, torch.randn(1, 16), 1e-5), P)  # one source: exactly it
    w = torch.randn(1, 16)
    V = torch.stack([*bank, P], dim=1)
    K = V / torch.sqrt(V.pow(2).mean(-1, keepdim=True) + 1e-5)
    p = torch.softmax(K @ (gamma * w[0]), dim=-1)
    assert rel_rms(attn_res_mix(bank, P, gamma, w, 1e-5), (p[..., None] * V).sum(1)) < 1e-6
    # Scaling a source does not change its logit (keys are normalised) but does scale its value.
    out = attn_res_mix(bank, P.bfloat16(), gamma.bfloat16(), w.bfloat16(), 1e-5)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("Tq, Tk", [(7, 7), (1, 9), (4, 11)])
def test_attention_kernel_matches_reference(Tq, Tk):
    q, k, v = torch.randn(Tq, 3, 24), torch.randn(Tk, 3, 24), torch.randn(Tk, 3, 8)
    scale = 24**-0.5
    out = causal_attention(q, k, v, scale)
    assert rel_rms(out, causal_attention_ref(q, k, v, scale)) < 1e-6
    # The last query sees every key: compare with a plain softmax row.
    p = torch.softmax(torch.einsum("hd,khd->hk", q[-1], k) * scale, -1)
    assert rel_rms(out[-1], torch.einsum("hk,khv->hv", p, v)) < 1e-6
    batched = causal_attention(
        q[None].repeat(2, 1, 1, 1), k[None].repeat(2, 1, 1, 1), v[None].repeat(2, 1, 1, 1), scale
    )
    assert rel_rms(batched[1], out) < 1e-6


def test_attention_mask_replaces_the_causal_rule():
    """An explicit mask (packed documents, cp shards) gives the reference's result, and a masked key never leaks:
    the same result with huge finite values in the keys and values it hides."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(9, 2, n, generator=gen) for n in (16, 16, 8))
    mask = torch.rand(9, 9, generator=gen) < 0.5
    mask[torch.arange(9), torch.arange(9)] = True
    hidden = torch.tensor([2, 6])  # keys no query may see
    mask[:, hidden], mask[hidden, 0] = False, True  # every query row still sees at least one key
    out = causal_attention(q, k, v, 0.25, mask)
    assert rel_rms(out, causal_attention_ref(q, k, v, 0.25, mask)) < 1e-6
    k2, v2 = k.clone(), v.clone()
    k2[hidden], v2[hidden] = 1e6, -1e6  # large but finite scores: the mask, not the softmax, must drop them
    assert torch.equal(causal_attention(q, k2, v2, 0.25, mask), out)


def _mla_decode_inputs(lens, dtype, gen, H=3, nope=16, rope=8, r=24, Dv=12):
    q_NHD = torch.randn(len(lens), H, nope + rope, generator=gen).to(dtype)
    latents = [torch.randn(n, r + rope, generator=gen).to(dtype) for n in lens]
    w = (torch.randn(H * (nope + Dv), r, generator=gen) * r**-0.5).to(dtype)
    # Padding past each length holds huge finite values: they must get probability exactly 0.
    block_NSR = torch.full((len(lens), max(lens), r + rope), 1e30, dtype=dtype)
    for i, x in enumerate(latents):
        block_NSR[i, : len(x)] = x
    return q_NHD, latents, block_NSR, w, nope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [1, 37, 5, 64], [17, 1, 1, 100, 2]])
def test_batched_absorbed_decode_matches_per_sequence_reference(lens, dtype):
    gen = torch.Generator().manual_seed(len(lens))
    q_NHD, latents, block_NSR, w, nope = _mla_decode_inputs(lens, dtype, gen)
    scale = q_NHD.shape[-1] ** -0.5
    out = mla_decode(q_NHD, block_NSR, torch.tensor(lens), *absorbed_weights(w, 3, nope), scale)
    ref = mla_decode_ref(q_NHD, latents, w, nope, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_rms(out.float(), ref.float()) <= (1e-6 if dtype == torch.float32 else 1e-2)
    # The absorbed form is the expanded attention rewritten: check the reference against keys and values expanded
    # from the latents (the last query of a causal attention sees every key).
    for i, x_SR in enumerate(latents):
        kv = (x_SR.float()[:, :24] @ w.float().T).view(-1, 3, nope + 12)
        k = torch.cat([kv[..., :nope], x_SR.float()[:, None, 24:].expand(-1, 3, 8)], -1)
        expanded = causal_attention_ref(q_NHD[i : i + 1].float(), k, kv[..., nope:], scale)[0]
        assert rel_rms(ref[i].float(), expanded) <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_router_bias_selects_but_does_not_weight():
    x, W = torch.randn(6, 16), torch.randn(8, 16)
    s = router_scores(x, W)
    assert s.dtype == torch.float32 and rel_rms(s, torch.sigmoid(x @ W.t())) < 1e-6
    bias = torch.zeros(8)
    bias[5] = 10.0  # force expert 5 into every choice
    idx, w = route_topk(s, bias, 3)
    assert (idx == 5).any(-1).all()
    assert torch.equal(idx, idx.sort(-1).values)
    expected = s.gather(-1, idx)
    assert rel_rms(w, expected / expected.sum(-1, keepdim=True)) < 1e-6
    _, w2 = route_topk(s, bias, 3, renormalize=False, scaling=2.5)
    assert rel_rms(w2, 2.5 * expected) < 1e-6


def test_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits).tolist() == [1, 0]
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, 1.0, top_k=2, generator=gen) for _ in range(200)])
    assert set(draws[:, 0].tolist()) == {1, 3}
    draws = torch.stack([sample(logits, 1.0, top_p=0.5, generator=gen) for _ in range(50)])
    assert set(draws[:, 0].tolist()) == {1}  # token 1 alone holds > 50% of the mass
    a = sample(logits, 0.7, generator=torch.Generator().manual_seed(3))
    b = sample(logits, 0.7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        sample(logits, temperature=-1.0)
    assert math.isclose(torch.softmax(torch.tensor([3.0, 2.0]), 0)[0].item(), 0.731, abs_tol=1e-3)


def test_fp32_ops_ignore_autocast():
    """Under bf16 autocast a matmul or conv would silently run in bf16; the ops the release fixes in fp32 opt out."""
    x, W = torch.randn(6, 16), torch.randn(8, 16)
    bank, P, g, w = [torch.randn(5, 16)], torch.randn(5, 16), torch.randn(16), torch.randn(1, 16)
    xc, wc = torch.randn(2, 9, 12), torch.randn(12, 1, 4)
    q, k, v = torch.randn(7, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 4)
    plain = (router_scores(x, W), attn_res_mix(bank, P, g, w, 1e-5), short_conv(xc, wc)[0],
             causal_attention(q, k, v, 0.3))  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = (router_scores(x, W), attn_res_mix(bank, P, g, w, 1e-5), short_conv(xc, wc)[0],
                causal_attention(q, k, v, 0.3))  # fmt: skip
    for a, b in zip(plain, auto):
        assert b.dtype == torch.float32 and torch.equal(a, b)


def test_short_conv_tail_of_right_padded_rows():
    """A right-padded row gives the same outputs and the same carried tail as the unpadded sequence."""
    w = torch.randn(6, 1, 4)
    tail = torch.randn(2, 3, 6)
    for n in (0, 1, 2, 5):
        x = torch.randn(1, n, 6)
        padded = torch.cat([x, torch.randn(1, 7 - n, 6)], dim=1)  # garbage after the sequence
        y, t = short_conv(x, w, tail[:1])
        y_pad, t_pad = short_conv(padded, w, tail[:1], torch.tensor([n]))
        assert torch.allclose(y_pad[:, :n], y, atol=1e-6) and torch.equal(t_pad, t)


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_few_matches_short_conv(dtype, T):
    gen = torch.Generator().manual_seed(11)
    N, C, W = 5, 24, 4
    w = torch.randn(C, 1, W, generator=gen)
    tail = torch.randn(N, W - 1, C, generator=gen).to(dtype)
    x = (3 * torch.randn(N, T, C, generator=gen)).to(dtype)
    y_ref, tail_ref = short_conv(x, w, tail)
    y, new_tail = short_conv_few(x, w, tail)
    assert torch.equal(new_tail, tail_ref)
    assert rel_rms(y.float(), y_ref.float()) <= (1e-6 if dtype == torch.float32 else 1e-2)


def _padded(x_TC, lens):
    """Right-pad packed sequences to [N, L, C] with garbage (the padded form must never read it)."""
    rows = torch.split(x_TC, lens)
    out = torch.full((len(lens), max(lens, default=0), x_TC.shape[-1]), 7.0, dtype=x_TC.dtype)
    for n, r in enumerate(rows):
        out[n, : len(r)] = r
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[5], [0], [1, 1, 1], [2048, 1, 1, 1], [0, 1, 2, 3, 17, 0], [2, 40, 1, 0, 9]])
@pytest.mark.parametrize("with_tail", [False, True])
def test_short_conv_varlen_is_bitwise_the_padded_form(lens, dtype, with_tail, one_thread):
    """Packed sequences of any lengths (0, 1, shorter than W-1, one long chunk beside decodes), with or without
    tails: outputs and new tails bitwise equal to `short_conv` on the right-padded rows (the training path relies
    on it for an unchanged loss), and equal to the token-loop reference on [tail; x]. Extreme magnitudes included:
    the packing must not mix sequences even where a leak would dominate."""
    gen = torch.Generator().manual_seed(sum(lens) + len(lens))
    N, C, W = len(lens), 12, 4
    w = torch.randn(C, 1, W, generator=gen)
    x_TC = torch.randn(sum(lens), C, generator=gen) * torch.tensor([1e4, 1e-30, 1.0]).repeat(C // 3)
    x_TC = x_TC.to(dtype)
    tail = (torch.randn(N, W - 1, C, generator=gen) * 1e3).to(dtype) if with_tail else None
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y_TC, new_tail = short_conv_varlen(x_TC, w, cu, tail)
    y_pad, tail_pad = short_conv(_padded(x_TC, lens), w, tail, torch.tensor(lens))
    assert y_TC.dtype == dtype and new_tail.dtype == dtype and new_tail.shape == (N, W - 1, C)
    assert torch.equal(y_TC, torch.cat([y_pad[n, :L] for n, L in enumerate(lens)]))
    assert torch.equal(new_tail, tail_pad)
    zeros = torch.zeros(N, W - 1, C, dtype=dtype)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        start = zeros[n] if tail is None else tail[n]
        ref = short_conv_ref(torch.cat([start, x_TC[a:b]]), w)[W - 1 :]
        assert torch.equal(y_TC[a:b], ref) or rel_rms(y_TC[a:b].float(), ref.float()) <= 1e-6
        assert torch.equal(new_tail[n], torch.cat([start, x_TC[a:b]])[-(W - 1) :])


def test_short_conv_varlen_gradients_match_the_padded_form(one_thread):
    """Training backpropagates through the packed conv: the gradients of x, the weight and the tails agree with
    the padded form's (a different reduction layout for the weight, so to rounding)."""
    gen = torch.Generator().manual_seed(5)
    lens, C, W = [7, 0, 1, 2, 30], 9, 4
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    x = torch.randn(sum(lens), C, generator=gen, requires_grad=True)
    w = torch.randn(C, 1, W, generator=gen, requires_grad=True)
    tail = torch.randn(len(lens), W - 1, C, generator=gen, requires_grad=True)
    dy = torch.randn(sum(lens), C, generator=gen)
    y, t = short_conv_varlen(x, w, cu, tail)
    grads = torch.autograd.grad((y * dy).sum() + t.sum(), (x, w, tail))
    y_pad, t_pad = short_conv(_padded(x, lens), w, tail, torch.tensor(lens))
    y_ref = torch.cat([y_pad[n, :L] for n, L in enumerate(lens)])
    grads_ref = torch.autograd.grad((y_ref * dy).sum() + t_pad.sum(), (x, w, tail))
    for g, g_ref in zip(grads, grads_ref):
        assert rel_rms(g, g_ref) <= 1e-6


def test_roll_tail_is_the_conv_tail_after_a_prefix():
    gen = torch.Generator().manual_seed(6)
    N, G, C, W = 4, 5, 6, 4
    tail, x = torch.randn(N, W - 1, C, generator=gen), torch.randn(N, G, C, generator=gen)
    used = torch.tensor([0, 1, 2, 5])
    rolled = roll_tail(tail, x, used)
    for n, c in enumerate(used.tolist()):
        assert torch.equal(rolled[n], short_conv(x[n : n + 1, :c], torch.randn(C, 1, W), tail[n : n + 1])[1][0])
