"""The CPU decode kernels (ops/cpu_kernels) against their torch references: the bf16 GEMV against `F.linear` and an
fp64 product, the fused experts against the torch expert path (model/moe.py) and DenseMLP, on ragged sizes and
extreme values; the dispatch falls back wherever a kernel does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_marks import needs_kernels

from openk3.model.layers import DenseMLP
from openk3.model.moe import GroupedExperts, fused_dispatch, grouped_dispatch, local_dispatch
from openk3.ops import cpu_kernels, dispatch

pytestmark = needs_kernels


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


# Error bounds that hold for every summation order. Which order torch's GEMV uses depends on the machine (oneDNN
# picks native bf16 dot products on AVX512-BF16, FMA chains elsewhere), so a tolerance fitted on one machine fails on
# another; these bounds are the worst case over all orders (Higham, Accuracy and Stability, Thm 3.1), computed in fp64.
U32 = 2.0**-24  # fp32 unit roundoff
ELEMENTWISE_U = 32  # SiTU's tanh, sigmoid, divisions and products in fp32: a few ulps each, 32 covers them with room
GATE_SLOPE = 0.93  # max |d/da 4 tanh(a/4) sigmoid(a)| (0.9264, measured on a fine grid); |d/db 25 tanh(b/25)| <= 1


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): |fl(x . y) - x . y| <= gamma_n |x| . |y| for a length-n fp32 dot product."""
    return n * U32 / (1 - n * U32)


def _glu_exact_and_bound(x, w1, w3, w2, beta, linear_beta):
    """down(SiTU(gate(x), up(x))) in fp64 and a bound on any fp32 evaluation's error, first order in u plus the
    cross term: the two input GEMVs' errors pushed through SiTU's slopes, SiTU's own roundings, then the down GEMV."""
    x, w1, w3, w2 = (t.double() for t in (x, w1, w3, w2))
    a, b = x @ w1.T, x @ w3.T
    da, db = _gamma(x.shape[-1]) * (x.abs() @ w1.abs().T), _gamma(x.shape[-1]) * (x.abs() @ w3.abs().T)
    gate = beta * torch.tanh(a / beta) * torch.sigmoid(a)
    up = linear_beta * torch.tanh(b / linear_beta)
    h = gate * up
    dh = GATE_SLOPE * da * up.abs() + gate.abs() * db + GATE_SLOPE * da * db + ELEMENTWISE_U * U32 * h.abs()
    y = h @ w2.T
    dy = dh @ w2.abs().T + _gamma(h.shape[-1]) * ((h.abs() + dh) @ w2.abs().T)
    return y, dy


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("I, O", [(1, 3), (63, 17), (64, 64), (1000, 129), (1024, 1)])
def test_gemv_equals_linear_to_rounding(rows, I, O):
    x, W = _bf16(rows, I, seed=1), _bf16(O, I, seed=2)
    y = cpu_kernels.linear_gemv(x, W)
    exact = x.double() @ W.double().T
    ref = F.linear(x, W)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, O)
    # Both are fp32 sums (in any order) rounded once to bf16: within the fp32 summation bound of the exact product,
    # then one bf16 rounding (2^-8 relative) of that.
    sum_err = _gamma(I) * (x.double().abs() @ W.double().abs().T)
    tol = (exact.abs() + sum_err) * 2**-8 + sum_err
    assert ((y.double() - exact).abs() <= tol).all()
    assert ((ref.double() - exact).abs() <= tol).all()


def test_gemv_keeps_leading_shape_and_extreme_values():
    W = _bf16(40, 70, seed=3)
    x = _bf16(2, 3, 70, seed=4)  # [..., I] with 6 rows
    x[0, 0, :5] = torch.tensor([3e38, -3e38, 1e-38, 0.0, -0.0]).bfloat16()
    y = cpu_kernels.linear_gemv(x, W)
    ref = F.linear(x, W)
    assert y.shape == (2, 3, 40)
    # Overflow where it must: an exact result beyond bf16's range is inf in any order. Where no partial sum can
    # reach fp32's range (sum of |terms| below it) the result is finite in any order. Between the two, whether a
    # partial sum overflows depends on the order (3e38 * 1.2 alone overflows, paired with -3e38 * 1.1 first it does
    # not), so the kernel and torch may differ there and neither is wrong.
    exact = x.double() @ W.double().T
    terms = x.double().abs() @ W.double().abs().T
    must_overflow = exact.abs() > 1.01 * torch.finfo(torch.float32).max
    must_be_finite = terms < 0.99 * torch.finfo(torch.float32).max
    assert must_overflow.sum() > 0 and (~must_be_finite).sum() > must_overflow.sum()  # all three cases occur
    for out in (y, ref):
        assert out[must_overflow].isinf().all() and out[must_be_finite].isfinite().all()
        sum_err = _gamma(70) * terms[must_be_finite]
        err = (out[must_be_finite].double() - exact[must_be_finite]).abs()
        assert (err <= (exact[must_be_finite].abs() + sum_err) * 2**-8 + sum_err).all()
    xn = x.clone()
    xn[1, 2, 0] = float("nan")
    assert cpu_kernels.linear_gemv(xn, W)[1, 2].isnan().all()


def test_gemv_applies_only_where_it_should():
    W, x = _bf16(8, 16), _bf16(1, 16)
    assert cpu_kernels.applies(x, W)
    assert not cpu_kernels.applies(x.float(), W.float())  # fp32: torch's GEMV is at bandwidth already
    assert not cpu_kernels.applies(_bf16(9, 16), W)  # more rows than MAX_ROWS: a GEMM, torch's
    assert not cpu_kernels.applies(x, W.t().contiguous().t())  # non-contiguous weight
    Wg = torch.nn.Parameter(W.clone())
    assert not cpu_kernels.applies(x, Wg)  # autograd needs it
    with torch.no_grad():
        assert cpu_kernels.applies(x, Wg)
    with dispatch.use_impl("linear", "ref"):
        assert dispatch.select("linear", x.device) == "ref"


def _experts(dtype, E=6, L=70, Fh=50, seed=0):
    ex = GroupedExperts(E, L, Fh, 4.0, 25.0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ex.to(dtype).requires_grad_(False)


def _experts_exact_and_bound(z, idx, w, ex):
    """Each token's k experts (`_glu_exact_and_bound`), weighted and added in fp32: [T, L] exact and bound."""
    exact, bound = torch.zeros(z.shape, dtype=torch.float64), torch.zeros(z.shape, dtype=torch.float64)
    k = idx.shape[1]
    for t in range(idx.shape[0]):
        for j, e in enumerate(idx[t].tolist()):
            y, dy = _glu_exact_and_bound(z[t], ex.w1[e], ex.w3[e], ex.w2[e], ex.beta, ex.linear_beta)
            exact[t] += float(w[t, j]) * y
            bound[t] += float(w[t, j]) * (dy + _gamma(k + 1) * (y.abs() + dy))  # the weight product and the k adds
    return exact, bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_fused_experts_equal_the_torch_path(dtype, k, T):
    ex = _experts(dtype)
    g = torch.Generator().manual_seed(k + 10 * T)
    z = (torch.randn(T, 70, generator=g) * 3).to(dtype)  # large enough to reach the SiTU caps
    idx = torch.stack([torch.randperm(6, generator=g)[:k].sort().values for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    fused = dispatch.fused_experts(z[:1], [ex.w1, ex.w3, ex.w2])
    assert fused is not None
    out = fused_dispatch(fused, z, idx, w, ex)
    with dispatch.use_impl("linear", "ref"):
        ref = grouped_dispatch(z, idx, w, ex)
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:  # both within the any-order fp32 bound of the exact result (the bound checked on both)
        exact, bound = _experts_exact_and_bound(z, idx, w, ex)
        assert ((out.double() - exact).abs() <= bound).all()
        assert ((ref.double() - exact).abs() <= bound).all()
    else:  # the same roundings at the same places: equal but for a last-bit flip where tanh/exp differ by an ulp
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2**-7 + 1e-3).all()
        assert (diff == 0).float().mean() > 0.9


def test_local_dispatch_picks_the_kernel_and_matches_the_reference():
    ex = _experts(torch.float32)
    g = torch.Generator().manual_seed(3)
    z, idx, w = torch.randn(2, 70, generator=g), torch.tensor([[0, 3], [1, 5]]), torch.rand(2, 2, generator=g)
    with dispatch.use_impl("experts", "ref"), dispatch.use_impl("linear", "ref"):
        ref = local_dispatch(z, idx, w, ex)
    torch.testing.assert_close(local_dispatch(z, idx, w, ex), ref, rtol=1e-5, atol=1e-5)
    ex.requires_grad_(True)  # training: autograd needs the torch path
    assert dispatch.fused_experts(z[:1], [ex.w1, ex.w3, ex.w2]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_dense_mlp_equals_the_torch_path(dtype):
    mlp = DenseMLP(90, 130, 4.0, 25.0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    mlp = mlp.to(dtype).requires_grad_(False)
    x = (torch.randn(3, 90, generator=g) * 2).to(dtype)
    with torch.no_grad():
        out = mlp(x)
        with dispatch.use_impl("experts", "ref"), dispatch.use_impl("linear", "ref"):
            ref = mlp(x)
    if dtype == torch.float32:  # both within the any-order fp32 bound of the exact result
        weights = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        exact, bound = _glu_exact_and_bound(x, *weights, mlp.beta, mlp.linear_beta)
        assert ((out.double() - exact).abs() <= bound).all()
        assert ((ref.double() - exact).abs() <= bound).all()
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7)


def test_kernel_refuses_bad_arguments():
    with pytest.raises(RuntimeError, match="MAX_ROWS|refused"):
        W = _bf16(4, 8)
        y = torch.empty(9, 4, dtype=torch.bfloat16)
        x = _bf16(9, 8)
        if cpu_kernels._lib.openk3_gemv_bf16(x.data_ptr(), W.data_ptr(), y.data_ptr(), 9, 4, 8):
            raise RuntimeError("refused rows=9 (at most MAX_ROWS)")
