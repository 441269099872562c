"""bf16 products on a CPU without bf16 arithmetic (ops/widen.py) against torch's bf16 products and the fp64 one:
equal within the rounding every summation order allows, on ragged sizes, tiles, biases, autograd, autocast and
extreme values; which path runs follows the CPU's bf16 verdict; "auto" serves a bf16 checkpoint in fp32 where the
widened weights fit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openk3 import K3ForCausalLM
from openk3.ops import dispatch, widen
from openk3.ops.cpu_features import CPUFeatures

NO_BF16 = CPUFeatures("x86_64", frozenset({"avx2", "fma", "f16c"}))
BF16 = CPUFeatures("x86_64", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
U32, U_BF16 = 2.0**-24, 2.0**-8  # unit roundoffs


@pytest.fixture
def no_bf16(monkeypatch):
    monkeypatch.setattr(widen, "features", lambda: NO_BF16)


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _tiny() -> K3ForCausalLM:
    model = K3ForCausalLM("tiny")
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def _bound(x, w, bias=None):
    """|y - exact| for y = rnd_bf16(fp32 sum in any order): fp32 accumulation (Higham: I u32 sum |x w|, for any
    order) plus one bf16 rounding of the result."""
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    mag = F.linear(x.double().abs(), w.double().abs(), None if bias is None else bias.double().abs())
    return exact, (x.shape[-1] + 1) * U32 * mag * (1 + U_BF16) + U_BF16 * exact.abs() + 1e-30


@pytest.mark.parametrize("rows, O, I", [(1, 7, 5), (9, 33, 17), (64, 130, 96), (3, 1000, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("gemm", ["mkl", "torch"])
def test_widened_linear_is_the_bf16_product_rounded_once(no_bf16, monkeypatch, rows, O, I, with_bias, gemm):
    """MKL's bf16 GEMM and torch's fp32 one on widened tiles; tiled (ragged last tile) and whole; against fp64
    within the any-order bound, and against torch's own bf16 F.linear within that bound twice over (both are
    roundings of the same fp32 sums)."""
    if gemm == "mkl" and widen.mkl_gemm_bf16() is None:
        pytest.skip("torch is built without MKL here")
    if gemm == "torch":
        monkeypatch.setattr(widen, "mkl_gemm_bf16", lambda: None)
    x, w = _bf16(2, rows, I, seed=1), _bf16(O, I, seed=2)
    bias = _bf16(O, seed=3) if with_bias else None
    exact, bound = _bound(x, w, bias)
    ref = F.linear(x, w, bias)
    for tile_bytes in (widen.TILE_BYTES, 7 * I * 4):
        monkeypatch.setattr(widen, "TILE_BYTES", tile_bytes)
        y = widen.linear(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (2, rows, O)
        assert ((y.double() - exact).abs() <= bound).all()
        assert ((y.double() - ref.double()).abs() <= 2 * bound).all()


def test_extreme_values_round_like_torch(no_bf16):
    """Large and tiny magnitudes, overflow to inf, NaN and inf operands: the same specials as torch's bf16 product."""
    x = torch.tensor([[3e38, 1.0, -2.0], [1e-38, 1e-38, 1e-38], [float("nan"), 1.0, 1.0], [float("inf"), 0.5, 1.0]])
    w = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1e-30, 1e30, -1.0]])
    x, w = x.bfloat16(), w.bfloat16()
    y, ref = widen.linear(x, w), F.linear(x, w)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    finite = ~(ref.isnan() | ref.isinf())
    exact, bound = _bound(x.nan_to_num(0, 0, 0), w)
    assert ((y.double() - exact).abs() <= bound)[finite].all()


def test_gradients_are_the_fp32_gradients_rounded_to_bf16(no_bf16):
    """With autograd the product is differentiable: the gradients of x, w and the bias equal torch's bf16 ones
    within bf16 rounding (both accumulate in fp32)."""
    x, w, b = _bf16(13, 24, seed=4), _bf16(10, 24, seed=5), _bf16(10, seed=6)
    grads = []
    for fn in (widen.linear, F.linear):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*leaves)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for a, r in zip(*grads, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), r.float(), rtol=2**-7, atol=2**-7)


def test_bf16_autocast_products_are_widened(no_bf16):
    """Under CPU bf16 autocast an fp32 linear is a bf16 product: the operands rounded to bf16, the result bf16."""
    x, w = torch.randn(17, 40), torch.randn(21, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert widen.widens(x, w)
        y, ref = dispatch.linear(x, w), F.linear(x, w)
    assert y.dtype == ref.dtype == torch.bfloat16
    exact, bound = _bound(x.bfloat16(), w.bfloat16())
    assert ((y.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=1e-2)
    assert not widen.widens(x, w)  # fp32 outside autocast stays fp32


def test_which_products_are_widened(monkeypatch):
    x, w = _bf16(4, 8), _bf16(3, 8)
    monkeypatch.setattr(widen, "features", lambda: NO_BF16)
    assert widen.widens(x, w) and not widen.widens(x.float(), w.float())
    monkeypatch.setattr(widen, "features", lambda: BF16)
    assert not widen.widens(x, w)  # bf16 arithmetic: torch's bf16 product
    a, b = _bf16(2, 3, 5), _bf16(2, 5, 4)
    monkeypatch.setattr(widen, "features", lambda: NO_BF16)
    torch.testing.assert_close(widen.matmul(a, b).float(), (a @ b).float(), rtol=2**-7, atol=1e-2)


def test_a_bf16_model_prefill_runs_widened_products(no_bf16, monkeypatch):
    """Every bf16 product of a bf16 model's prefill on such a CPU goes through `widen.linear` (the projections, the
    experts, the head), and its logits are as close to the fp32 model's as torch's bf16 path (`use_impl("linear",
    "ref")`) is (measured on this tiny model: 5.9% against 7.9% rel. RMS; the two bf16 paths round the same sums
    in other orders, and six layers of bf16 amplify that)."""
    model = _tiny()
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    calls = []
    real = widen.linear
    monkeypatch.setattr(widen, "linear", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        fp32 = model(ids).logits
        assert not calls
        model.to_dtype(torch.bfloat16)
        out = model(ids).logits
        n = len(calls)
        with dispatch.use_impl("linear", "ref"):
            ref = model(ids).logits
    assert n >= 4 * model.text_config.num_hidden_layers and len(calls) == n

    def rel(a):
        return ((a.float() - fp32).norm() / fp32.norm()).item()

    assert rel(out) <= 1.25 * rel(ref) + 0.01, (rel(out), rel(ref))


def test_the_bf16_kda_tiles_are_not_used_without_bf16_arithmetic(monkeypatch):
    """The opt-in bf16-tile KDA op computes in fp32 (the "ref" op) on a CPU without bf16 arithmetic."""
    from openk3.ops.kda.ref import kda_gate

    monkeypatch.setattr(dispatch, "features", lambda: NO_BF16)
    used = []
    monkeypatch.setattr(dispatch, "kda_chunked_bf16", lambda *a, **k: used.append("bf16"))
    monkeypatch.setattr(dispatch, "kda_chunked_cpu", lambda *a, **k: used.append("fp32"))
    q = _bf16(1, 16, 2, 8)
    g = kda_gate(torch.randn(1, 16, 2, 8), torch.zeros(2), torch.zeros(16))
    with dispatch.use_impl("kda_chunked", "bf16"):
        dispatch.kda_chunked(q, q, q, g, q[..., 0])
    monkeypatch.setattr(dispatch, "features", lambda: BF16)
    with dispatch.use_impl("kda_chunked", "bf16"):
        dispatch.kda_chunked(q, q, q, g, q[..., 0])
    assert used == ["fp32", "bf16"]


def test_auto_computes_a_bf16_checkpoint_in_fp32_where_it_fits(monkeypatch):
    monkeypatch.setattr(widen, "available_memory", lambda: 8 * 2**30)
    monkeypatch.setattr(widen, "features", lambda: NO_BF16)
    dtype, why = widen.auto_dtype(torch.bfloat16, "cpu", 2**30)
    assert dtype is torch.float32 and "widened once" in why
    dtype, why = widen.auto_dtype(torch.bfloat16, "cpu", 5 * 2**30)  # over half of the 8 GiB available
    assert dtype is torch.bfloat16 and "tile by tile" in why
    assert widen.auto_dtype(torch.bfloat16, "cuda", 2**30)[0] is torch.bfloat16
    assert widen.auto_dtype(torch.float16, "cpu", 2**30)[0] is torch.float16
    monkeypatch.setattr(widen, "features", lambda: BF16)
    dtype, why = widen.auto_dtype(torch.bfloat16, "cpu", 2**30)
    assert dtype is torch.bfloat16 and "bf16 arithmetic" in why


def test_serving_dtype_of_a_checkpoint_and_k3_info(tmp_path, monkeypatch, capsys):
    """`serving_dtype("auto", ckpt)` sizes the checkpoint from its config; `k3 info --ckpt` prints the verdict."""
    from openk3.cli import main
    from openk3.serve.config import checkpoint_fp32_bytes, serving_dtype

    model = _tiny()
    model.save_pretrained(tmp_path)  # config.json declares bfloat16
    assert checkpoint_fp32_bytes(tmp_path) == 4 * sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(widen, "features", lambda: NO_BF16)
    assert serving_dtype("auto", tmp_path)[0] is torch.float32
    assert serving_dtype("bfloat16", tmp_path)[0] is torch.bfloat16  # asked for: kept, its products widened
    monkeypatch.setattr(widen, "features", lambda: BF16)
    assert serving_dtype("auto", tmp_path)[0] is torch.bfloat16
    assert main(["info", "--ckpt", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cpu " in out and "kernels " in out and "dtype auto  bf16" in out


def test_the_two_gemms_agree_and_empty_inputs_work(no_bf16, monkeypatch):
    """MKL's bf16 GEMM is bitwise the fp32 GEMM of the widened operands on these shapes (both sum in fp32); an
    empty input gives an empty output."""
    if widen.mkl_gemm_bf16() is None:
        pytest.skip("torch is built without MKL here")
    x, w = _bf16(37, 300, seed=9), _bf16(515, 300, seed=10)
    mkl = widen.linear(x, w)
    monkeypatch.setattr(widen, "mkl_gemm_bf16", lambda: None)
    torch.testing.assert_close(widen.linear(x, w).float(), mkl.float(), rtol=2**-8, atol=0)
    assert widen.linear(x[:0], w).shape == (0, 515)
