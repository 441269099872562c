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
from openk3.ops.conv import short_conv_few
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
    batched = causal_attention(q[None].repeat(2, 1, 1, 1), k[None].repeat(2, 1, 1, 1), v[None].repeat(2, 1, 1, 1), scale)
    assert rel_rms(batched[1], out) < 1e-6


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
