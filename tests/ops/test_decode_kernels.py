"""The CPU decode kernels (ops/cpu_kernels) against their torch references: the bf16 GEMV against `F.linear` and an
fp64 product, the fused experts against the torch expert path (model/moe.py) and DenseMLP, on ragged sizes and
extreme values; the dispatch falls back wherever a kernel does not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openk3.model.layers import DenseMLP
from openk3.model.moe import GroupedExperts, fused_dispatch, grouped_dispatch, local_dispatch
from openk3.ops import cpu_kernels, dispatch

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"no C compiler: {cpu_kernels._failed}")


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("I, O", [(1, 3), (63, 17), (64, 64), (1000, 129), (1024, 1)])
def test_gemv_equals_linear_to_rounding(rows, I, O):
    x, W = _bf16(rows, I, seed=1), _bf16(O, I, seed=2)
    y = cpu_kernels.linear_gemv(x, W)
    exact = x.double() @ W.double().T
    ref = F.linear(x, W)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, O)
    # Both are fp32 sums rounded once to bf16: each within one bf16 rounding (2^-8 relative) of the exact product,
    # plus the fp32 summation error.
    tol = exact.abs() * 2**-8 + 1e-5 * (x.double().abs() @ W.double().abs().T)
    assert ((y.double() - exact).abs() <= tol).all()
    assert ((ref.double() - exact).abs() <= tol).all()


def test_gemv_keeps_leading_shape_and_extreme_values():
    W = _bf16(40, 70, seed=3)
    x = _bf16(2, 3, 70, seed=4)  # [..., I] with 6 rows
    x[0, 0, :5] = torch.tensor([3e38, -3e38, 1e-38, 0.0, -0.0]).bfloat16()
    y = cpu_kernels.linear_gemv(x, W)
    ref = F.linear(x, W)
    assert y.shape == (2, 3, 40)
    assert torch.equal(y.isfinite(), ref.isfinite())  # overflow to inf where torch overflows
    finite = ref.isfinite()
    assert torch.allclose(y[finite].float(), ref[finite].float(), rtol=2**-7, atol=1e-2)
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
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
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
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_kernel_refuses_bad_arguments():
    with pytest.raises(RuntimeError, match="MAX_ROWS|refused"):
        W = _bf16(4, 8)
        y = torch.empty(9, 4, dtype=torch.bfloat16)
        x = _bf16(9, 8)
        if cpu_kernels._lib.openk3_gemv_bf16(x.data_ptr(), W.data_ptr(), y.data_ptr(), 9, 4, 8):
            raise RuntimeError("refused rows=9 (at most MAX_ROWS)")
