"""Tests for openk3.ops.kda (spec/kda.md §11 checklist, §6 bitwise prefix-invariance tests).

Metric: relative RMS error rms(a - b) / rms(b) (STYLE.md §5). Bitwise tests pin one CPU thread.
Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C tile rows.
"""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import kda_chunked, kda_fold, kda_gate, kda_recurrent, kda_step, kda_verify
from openk3.ops.kda.unit_lower import unit_lower_inverse, unit_lower_inverse_blocked, unit_lower_inverse_rows

IMPLS = {"recurrent": kda_recurrent, "chunked": kda_chunked}
LENGTHS = [1, 15, 16, 17, 63, 100, 1000]
CUTS = [1, 15, 16, 17, 37, 64]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def cuts_for(T: int) -> list[int]:
    return sorted({P for P in CUTS + [T - 1] if 0 < P < T})


def make_raw(B, T, H=2, K=32, V=16, seed=0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Layer-level inputs before normalisation, gate and sigmoid."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q_raw": randn(B, T, H, K),
        "k_raw": randn(B, T, H, K),
        "v": randn(B, T, H, V),
        "g_raw": 2 * randn(B, T, H, K),
        "beta_logit": randn(B, T, H),
    }


def make_params(N, H=2, K=32, V=16, seed=1, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "A_log": 0.5 * torch.randn(H, generator=gen, dtype=dtype),
        "dt_bias": torch.randn(H * K, generator=gen, dtype=dtype),
        "h0": torch.randn(N, H, K, V, generator=gen, dtype=dtype),
    }


def op_inputs(raw, params):
    """(q, k, v, g, beta) as the layer hands them to the op."""
    q = F.normalize(raw["q_raw"], dim=-1)
    k = F.normalize(raw["k_raw"], dim=-1)
    g = kda_gate(raw["g_raw"], params["A_log"], params["dt_bias"])
    return q, k, raw["v"], g, torch.sigmoid(raw["beta_logit"])


def random_op_inputs(B, T, H=2, K=32, V=16, seed=0, dtype=torch.float32):
    return op_inputs(make_raw(B, T, H, K, V, seed, dtype), make_params(B, H, K, V, seed + 1, dtype))


# 1. Gate


def test_gate_matches_fp64_closed_form_and_range():
    H, K = 4, 32
    gen = torch.Generator().manual_seed(0)
    # |z| <= e * 4 here; fp32 sigmoid rounds to exactly 0 or 1 only beyond |z| ~ 17 (the extreme-input test).
    g_raw = 4 * torch.rand(2, 50, H, K, generator=gen) - 2
    A_log = 2 * torch.rand(H, generator=gen) - 1
    dt_bias = 4 * torch.rand(H * K, generator=gen) - 2
    g = kda_gate(g_raw, A_log, dt_bias)
    z = A_log.double().exp()[:, None] * (g_raw.double() + dt_bias.double().view(H, K))
    expected = -5.0 * torch.sigmoid(z)
    assert g.dtype == torch.float32
    assert rel_rms(g, expected) <= 1e-6
    assert (g > -5).all() and (g < 0).all()
    # bf16 g_raw is upcast before the bias is added.
    g_bf16 = kda_gate(g_raw.bfloat16(), A_log, dt_bias)
    assert g_bf16.dtype == torch.float32
    assert torch.equal(g_bf16, kda_gate(g_raw.bfloat16().float(), A_log, dt_bias))
    assert rel_rms(kda_gate(g_raw, A_log, dt_bias, lower_bound=-2.0), expected * (2.0 / 5.0)) <= 1e-6


def test_gate_extreme_inputs_are_finite():
    H, K = 2, 8
    g_raw = torch.tensor([1e4, -1e4]).repeat(H, K // 2).reshape(1, 1, H, K).requires_grad_()
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.zeros(H * K, requires_grad=True)
    g = kda_gate(g_raw, A_log, dt_bias)
    assert g.isfinite().all() and (g >= -5).all() and (g <= 0).all()
    assert g.min() == -5.0 and g.max() == 0.0
    g.sum().backward()
    for x in (g_raw, A_log, dt_bias):
        assert x.grad.isfinite().all()


def test_gate_gradients_by_finite_differences():
    H, K = 2, 4
    gen = torch.Generator().manual_seed(3)
    args = (
        torch.randn(3, H, K, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(H, generator=gen, dtype=torch.float64, requires_grad=True),
        torch.randn(H * K, generator=gen, dtype=torch.float64, requires_grad=True),
    )
    assert torch.autograd.gradcheck(kda_gate, args)


# 2. Token loop vs the matrix form, fp64


def test_recurrent_matches_matrix_form_fp64():
    B, T, H, K, V = 2, 37, 2, 8, 4
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=5, dtype=torch.float64)
    h0 = make_params(B, H, K, V, seed=6, dtype=torch.float64)["h0"]
    scale = 0.3
    o, S = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float64 and S.dtype == torch.float64

    eye = torch.eye(K, dtype=torch.float64)
    S_ref = h0.clone()
    o_ref = torch.zeros(B, T, H, V, dtype=torch.float64)
    for t in range(T):
        kt, bt = k[:, t, :, :, None], beta[:, t, :, None, None]
        transition = (eye - bt * kt @ kt.mT) @ torch.diag_embed(g[:, t].exp())
        S_ref = transition @ S_ref + bt * kt @ v[:, t, :, None, :]
        o_ref[:, t] = (S_ref.mT @ (scale * q[:, t, :, :, None]))[..., 0]
    assert rel_rms(o, o_ref) <= 1e-12
    assert rel_rms(S, S_ref) <= 1e-12


# 3. Chunked vs recurrent


@pytest.mark.parametrize("T, with_h0", [(T, h0) for T in LENGTHS[:-1] for h0 in (False, True)] + [(1000, True)])
def test_chunked_matches_recurrent(T, with_h0):
    B, H, K, V = 2, 2, 32, 16
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=T)
    h0 = make_params(B, H, K, V, seed=T + 1)["h0"] if with_h0 else None
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    assert rel_rms(o, o_ref) <= 1e-5
    assert rel_rms(S, S_ref) <= 1e-5


def test_chunked_matches_recurrent_fp64():
    """In fp64 the tile algebra must agree with the token loop to ~1e-12: catches algebra errors fp32 hides."""
    B, T, H, K, V = 2, 100, 2, 16, 8
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=8, dtype=torch.float64)
    h0 = make_params(B, H, K, V, seed=9, dtype=torch.float64)["h0"]
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_rms(o, o_ref) <= 1e-12 and rel_rms(S, S_ref) <= 1e-12


def test_bf16_inputs_dtypes():
    B, T, H, K, V = 1, 40, 2, 16, 8
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=10)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    h0 = make_params(B, H, K, V, seed=11)["h0"]
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == o_ref.dtype == torch.bfloat16
    assert S.dtype == S_ref.dtype == torch.float32
    assert rel_rms(S, S_ref) <= 1e-5
    assert rel_rms(o, o_ref) <= 1e-2
    o_none, S_none = kda_chunked(q, k, v, g, beta, initial_state=h0)
    assert S_none is None and torch.equal(o_none, o)


SEQ_LENS = [5, 16, 37]


def packed_inputs(seed=20, H=2, K=32, V=16):
    T = sum(SEQ_LENS)
    q, k, v, g, beta = random_op_inputs(1, T, H, K, V, seed=seed)
    h0 = make_params(len(SEQ_LENS), H, K, V, seed=seed + 1)["h0"]
    cu_seqlens = torch.tensor([0] + SEQ_LENS).cumsum(0).to(torch.int32)
    return (q, k, v, g, beta), h0, cu_seqlens


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("with_h0", [False, True])
def test_varlen_matches_each_sequence_alone(impl, with_h0):
    op = IMPLS[impl]
    inputs, h0, cu_seqlens = packed_inputs()
    h0 = h0 if with_h0 else None
    o, S = op(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o_rec, S_rec = kda_recurrent(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    assert S.shape == (len(SEQ_LENS), 2, 32, 16)
    assert rel_rms(o, o_rec) <= 1e-5 and rel_rms(S, S_rec) <= 1e-5
    for n in range(len(SEQ_LENS)):
        tokens = slice(int(cu_seqlens[n]), int(cu_seqlens[n + 1]))
        h0_n = None if h0 is None else h0[n : n + 1]
        o_n, S_n = op(*(x[:, tokens] for x in inputs), initial_state=h0_n, output_final_state=True)
        assert rel_rms(o[:, tokens], o_n) <= 1e-6
        assert rel_rms(S[n : n + 1], S_n) <= 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_varlen_other_sequence_perturbation_is_bitwise_invisible(impl, one_thread):
    """Spec §6 test 5: changing sequence 1 must not change any bit of sequences 0 and 2."""
    op = IMPLS[impl]
    inputs, h0, cu_seqlens = packed_inputs()
    other = random_op_inputs(1, sum(SEQ_LENS), seed=99)
    mine = torch.zeros(sum(SEQ_LENS), dtype=torch.bool)
    mine[cu_seqlens[1] : cu_seqlens[2]] = True
    perturbed = [torch.where(mine.view(1, -1, *([1] * (x.dim() - 2))), y, x) for x, y in zip(inputs, other)]
    h0_perturbed = h0.clone()
    h0_perturbed[1] = 7.0
    o, S = op(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    o_p, S_p = op(*perturbed, initial_state=h0_perturbed, output_final_state=True, cu_seqlens=cu_seqlens)
    assert torch.equal(o[:, ~mine], o_p[:, ~mine])
    assert torch.equal(S[[0, 2]], S_p[[0, 2]])
    assert not torch.equal(o[:, mine], o_p[:, mine])


def test_input_validation():
    q, k, v, g, beta = random_op_inputs(2, 10, 2, 8, 4)
    with pytest.raises(ValueError, match="batch size 1"):
        kda_chunked(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_recurrent(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 4, 8))
    with pytest.raises(ValueError, match="beta"):
        kda_chunked(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], cu_seqlens=torch.tensor([0, 4, 9]))


# 4. Saturated gates and the tile-length limit


@pytest.mark.parametrize("chunk_size", [16, 17])
@pytest.mark.parametrize("g_value", [-5.0, -4.999])
def test_saturated_gates(chunk_size, g_value):
    B, T, H, K, V = 2, 70, 2, 32, 16
    q, k, v, _, beta = random_op_inputs(B, T, H, K, V, seed=30)
    g = torch.full((B, T, H, K), g_value)
    h0 = make_params(B, H, K, V, seed=31)["h0"]
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    assert o.isfinite().all() and S.isfinite().all()
    assert rel_rms(o, o_ref) <= 1e-5 and rel_rms(S, S_ref) <= 1e-5


def test_chunk_size_limit():
    q, k, v, _, beta = random_op_inputs(1, 40, 2, 16, 8, seed=32)
    g = torch.full(q.shape, -4.9)
    with pytest.raises(ValueError, match="chunk_size=18"):
        kda_chunked(q, k, v, g, beta, chunk_size=18, lower_bound=-5.0)
    with pytest.raises(ValueError, match="chunk_size=16"):
        kda_chunked(q, k, v, g, beta, chunk_size=16, lower_bound=-6.0)
    # 18 * 4.9 = 88.2 < 88.72: allowed, and finite on gates saturated at that bound.
    o, _ = kda_chunked(q, k, v, g, beta, chunk_size=18, lower_bound=-4.9)
    o_ref, _ = kda_recurrent(q, k, v, g, beta)
    assert o.isfinite().all() and rel_rms(o, o_ref) <= 1e-5


@pytest.mark.parametrize("case", ["saturated", "saturated_at_bound", "near_parallel_keys", "no_decay_parallel_keys"])
def test_unit_lower_inverse_matches_forward_substitution(case):
    """The three tile paths' (I + L)^-1 (reference solve, fp32 rows, bf16 path's block doubling) against fp64
    forward substitution on the L matrices that stress them (spec §4.3)."""
    C, H, K = 16, 8, 32
    gen = torch.Generator().manual_seed(40)
    if case.startswith("saturated"):
        k = F.normalize(torch.randn(H, C, K, generator=gen), dim=-1)
        g = torch.full((H, C, K), -5.0 if case == "saturated_at_bound" else -4.999)
    else:
        base = torch.randn(H, 1, K, generator=gen)
        k = F.normalize(base + 1e-3 * torch.randn(H, C, K, generator=gen), dim=-1)
        g = torch.full((H, C, K), -0.01 if case == "near_parallel_keys" else 0.0)
    beta = torch.rand(H, C, 1, generator=gen) * 0.5 + 0.5
    G = g.cumsum(-2)
    L = torch.tril(beta * ((k * G.exp()) @ (k * (-G).exp()).mT), diagonal=-1)

    L64 = L.double()
    Tinv_ref = torch.zeros_like(L64)
    for i in range(C):
        Tinv_ref[:, i, i] = 1.0
        Tinv_ref[:, i] -= (L64[:, i, :, None] * Tinv_ref).sum(-2)
    out = torch.full_like(L, float("nan"))  # the blocked form writes into a given buffer: every entry is set
    for Tinv in (unit_lower_inverse(L), unit_lower_inverse_rows(L), unit_lower_inverse_blocked(L, out=out)):
        assert Tinv.isfinite().all()
        assert torch.equal(Tinv.triu(1), torch.zeros_like(Tinv))
        assert (Tinv - Tinv_ref).abs().max() <= 1e-6 * max(1.0, Tinv_ref.abs().max().item())


# 5. Gradients


def run_with_grads(op, leaves, cot_o, cot_S, dtype, **kwargs):
    """Forward through kda_gate and the op from cloned leaves in `dtype`; returns grads by name (incl. dg)."""
    x = {name: t.detach().to(dtype).requires_grad_() for name, t in leaves.items()}
    g = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"])
    g.retain_grad()
    o, S = op(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True, **kwargs)
    ((o * cot_o.to(dtype)).sum() + (S * cot_S.to(dtype)).sum()).backward()
    grads = {name: t.grad for name, t in x.items()}
    grads["g"] = g.grad
    return grads


def gradient_leaves(B, T, H, K, V, seed, saturate=False):
    raw = make_raw(B, T, H, K, V, seed)
    params = make_params(B, H, K, V, seed + 1)
    if saturate:
        raw["g_raw"] = raw["g_raw"].sign() * 30.0
    q, k, v, _, beta = op_inputs(raw, params)
    return {"q": q, "k": k, "v": v, "g_raw": raw["g_raw"], "beta": beta, **params}


@pytest.mark.parametrize("T", [17, 40])
def test_gradients_match_fp64_recurrent(T):
    B, H, K, V = 2, 2, 16, 8
    leaves = gradient_leaves(B, T, H, K, V, seed=50 + T)
    gen = torch.Generator().manual_seed(52)
    cot_o, cot_S = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    ref = run_with_grads(kda_recurrent, leaves, cot_o, cot_S, torch.float64)
    rec = run_with_grads(kda_recurrent, leaves, cot_o, cot_S, torch.float32)
    chunk = run_with_grads(kda_chunked, leaves, cot_o, cot_S, torch.float32)
    assert set(ref) == {"q", "k", "v", "g_raw", "beta", "A_log", "dt_bias", "h0", "g"}
    for name in ref:
        assert rel_rms(chunk[name], ref[name]) <= 1e-4, name
        assert rel_rms(rec[name], ref[name]) <= 1e-4, name
        assert rel_rms(chunk[name], rec[name]) <= 1e-4, name


@pytest.mark.parametrize("chunk_size", [16, 17])
@pytest.mark.parametrize("g_value", [-5.0, -4.999])
def test_gradients_saturated_gates(chunk_size, g_value):
    B, T, H, K, V = 1, 50, 2, 16, 8
    leaves = gradient_leaves(B, T, H, K, V, seed=60, saturate=True)
    gen = torch.Generator().manual_seed(61)
    cot_o, cot_S = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    # The gate's own gradient vanishes at saturation, so drive g directly as a leaf here.
    results = []
    for op, kwargs in ((kda_recurrent, {}), (kda_chunked, {"chunk_size": chunk_size})):
        xs = {n: leaves[n].clone().requires_grad_() for n in ("q", "k", "v", "beta", "h0")}
        g = torch.full((B, T, H, K), g_value, requires_grad=True)
        o, S = op(xs["q"], xs["k"], xs["v"], g, xs["beta"], initial_state=xs["h0"], output_final_state=True, **kwargs)
        ((o * cot_o).sum() + (S * cot_S).sum()).backward()
        results.append({**{n: t.grad for n, t in xs.items()}, "g": g.grad})
    rec, chunk = results
    for name in rec:
        assert chunk[name].isfinite().all(), name
        assert rel_rms(chunk[name], rec[name]) <= 1e-4, name
    # Through the gate, saturated raw inputs must not give NaN either.
    grads = run_with_grads(kda_chunked, leaves, cot_o, cot_S, torch.float32, chunk_size=chunk_size)
    assert all(t.isfinite().all() for t in grads.values())


# 6. Spec §6: anchoring, bitwise


def perturb_future(raw, P, seed):
    """Fresh values at positions >= P, with gates pushed to saturation (g = -5) and to g = 0 as well."""
    fresh = make_raw(*raw["q_raw"].shape[:3], raw["q_raw"].shape[3], raw["v"].shape[3], seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pick = torch.randint(0, 3, fresh["g_raw"].shape, generator=gen)
    fresh["g_raw"] = torch.where(pick == 0, 1e4, torch.where(pick == 1, -1e4, fresh["g_raw"]))
    out = {}
    for name, x in raw.items():
        y = x.clone()
        y[:, P:] = fresh[name][:, P:]
        out[name] = y
    return out


def causal_run(op, raw, params, P, cot_o):
    """o and the grads of loss = sum_{t<P} <c_t, o_t> w.r.t. every layer-level input and parameter."""
    leaves = {n: t.clone().requires_grad_() for n, t in {**raw, **params}.items()}
    q, k, v, g, beta = op_inputs(leaves, leaves)
    o, _ = op(q, k, v, g, beta, initial_state=leaves["h0"], output_final_state=True)
    (o[:, :P] * cot_o[:, :P]).sum().backward()
    return o.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T", LENGTHS[1:])
def test_future_perturbation_and_causal_gradients(impl, T, one_thread):
    """Spec §6 tests 1 and 2 (T = 1 has no cut point; it is covered by the equivalence tests)."""
    op = IMPLS[impl]
    B, H, K, V = 1, 2, 16, 8
    raw = make_raw(B, T, H, K, V, seed=70 + T)
    params = make_params(B, H, K, V, seed=71 + T)
    cot_o = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(72))
    for P in cuts_for(T):
        o, grads = causal_run(op, raw, params, P, cot_o)
        o_p, grads_p = causal_run(op, perturb_future(raw, P, seed=P), params, P, cot_o)
        assert torch.equal(o[:, :P], o_p[:, :P]), P
        assert not torch.equal(o[:, P:], o_p[:, P:]), P
        for name in raw:
            assert torch.equal(grads[name][:, :P], grads_p[name][:, :P]), (P, name)
            assert (grads[name][:, P:] == 0).all() and (grads_p[name][:, P:] == 0).all(), (P, name)
        for name in params:
            assert torch.equal(grads[name], grads_p[name]), (P, name)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T", LENGTHS[1:])
def test_append_truncated_run_is_prefix(impl, T, one_thread):
    """Spec §6 test 3: the prefix-cache contract."""
    op = IMPLS[impl]
    B, H, K, V = 2, 2, 16, 8
    inputs = random_op_inputs(B, T, H, K, V, seed=80 + T)
    h0 = make_params(B, H, K, V, seed=81)["h0"]
    o_full, _ = op(*inputs, initial_state=h0)
    for P in cuts_for(T):
        o_P, _ = op(*(x[:, :P] for x in inputs), initial_state=h0)
        assert torch.equal(o_P, o_full[:, :P]), P


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T", [63, 100])
def test_split_with_state_handover(impl, T, one_thread):
    """Spec §6 test 4: bitwise at tile multiples (any cut for the token loop), within 1e-5 elsewhere."""
    op = IMPLS[impl]
    B, H, K, V = 2, 2, 16, 8
    inputs = random_op_inputs(B, T, H, K, V, seed=90 + T)
    h0 = make_params(B, H, K, V, seed=91)["h0"]
    o_full, S_full = op(*inputs, initial_state=h0, output_final_state=True)
    for P in cuts_for(T):
        o_a, S_a = op(*(x[:, :P] for x in inputs), initial_state=h0, output_final_state=True)
        o_b, S_b = op(*(x[:, P:] for x in inputs), initial_state=S_a, output_final_state=True)
        o_split = torch.cat([o_a, o_b], dim=1)
        if impl == "recurrent" or P % 16 == 0:
            assert torch.equal(o_split, o_full), P
            assert torch.equal(S_b, S_full), P
        else:
            assert rel_rms(o_split, o_full) <= 1e-5 and rel_rms(S_b, S_full) <= 1e-5, P


# 7. Decode step


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_step_loop_is_bitwise_recurrent(v_dtype, one_thread):
    B, T, H, K, V = 3, 40, 2, 32, 16
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=100)
    v = v.to(v_dtype)
    h0 = make_params(B, H, K, V, seed=101)["h0"]
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    state = h0
    for t in range(T):
        state_before = state.clone()
        o_t, new_state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        assert torch.equal(state, state_before), "kda_step must not modify its input state"
        assert new_state.data_ptr() != state.data_ptr()
        assert o_t.dtype == v_dtype and new_state.dtype == torch.float32
        assert torch.equal(o_t, o_ref[:, t]), t
        state = new_state
    assert torch.equal(state, S_ref)


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.bfloat16])
def test_verify_and_fold_are_bitwise_the_step_loop(v_dtype, one_thread):
    """`kda_verify` runs G steps without touching the state, its outputs bitwise those of a `kda_step` loop (and so
    of `kda_recurrent`); `kda_fold` of the first c_n recorded steps is bitwise the state after c_n plain steps, with
    c_n = 0 keeping the state (spec/serving.md §4.4)."""
    N, G, H, K, V = 4, 5, 2, 32, 16
    q, k, v, g, beta = random_op_inputs(N, G, H, K, V, seed=120)
    v = v.to(v_dtype)
    h0 = make_params(N, H, K, V, seed=121)["h0"]
    before = h0.clone()
    o_NGHV, steps = kda_verify(q, k, v, g, beta, h0)
    assert torch.equal(h0, before)
    o_ref, _ = kda_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o_NGHV.dtype == v_dtype and torch.equal(o_NGHV, o_ref)
    state, snapshots = h0, [h0]
    for t in range(G):
        _, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        snapshots.append(state)
    consumed = torch.tensor([0, 1, 3, 5])
    folded = kda_fold(steps, h0, consumed)
    assert torch.equal(h0, before)
    for n, c in enumerate(consumed.tolist()):
        assert torch.equal(folded[n], snapshots[c][n]), (n, c)


def test_step_matches_chunked_prefill():
    """Decode after a chunked prefill ≡ chunked over the whole sequence, within fp32 tolerance (spec §11.6)."""
    B, T, H, K, V = 2, 50, 2, 32, 16
    q, k, v, g, beta = random_op_inputs(B, T, H, K, V, seed=110)
    o_full, S_full = kda_chunked(q, k, v, g, beta, output_final_state=True)
    P = 37
    _, state = kda_chunked(*(x[:, :P] for x in (q, k, v, g, beta)), output_final_state=True)
    o_steps = []
    for t in range(P, T):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        o_steps.append(o_t)
    assert rel_rms(torch.stack(o_steps, 1), o_full[:, P:]) <= 1e-5
    assert rel_rms(state, S_full) <= 1e-5


# 8. Nothing reads uninitialised memory


def nan_filled(factory):
    def wrapper(*args, **kwargs):
        x = factory(*args, **kwargs)
        if x.is_floating_point():
            x.fill_(float("nan"))
        return x

    return wrapper


def nan_padded_view(x: torch.Tensor) -> torch.Tensor:
    """x as a non-contiguous view into a larger buffer whose extra tokens and channels are NaN."""
    shape = list(x.shape)
    shape[1] += 5
    shape[-1] += 3
    buffer = torch.full(shape, float("nan"), dtype=x.dtype)
    view = buffer[:, : x.shape[1], ..., : x.shape[-1]]
    view.copy_(x)
    return view


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("packed", [False, True])
def test_nan_poisoned_memory_is_never_read(impl, packed, monkeypatch):
    op = IMPLS[impl]
    if packed:
        inputs, h0, cu_seqlens = packed_inputs(seed=120, H=2, K=16, V=8)
    else:
        inputs = random_op_inputs(2, 37, 2, 16, 8, seed=120)
        h0, cu_seqlens = make_params(2, 2, 16, 8, seed=121)["h0"], None
    o_clean, S_clean = op(*inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)

    monkeypatch.setattr(torch, "empty", nan_filled(torch.empty))
    monkeypatch.setattr(torch, "empty_like", nan_filled(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled(torch.Tensor.new_empty))
    views = [nan_padded_view(x).requires_grad_() for x in inputs]
    o, S = op(*views, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.isfinite().all() and S.isfinite().all()
    assert rel_rms(o, o_clean) <= 1e-6 and rel_rms(S, S_clean) <= 1e-6
    (o.sum() + S.sum()).backward()
    for x in views:
        assert x.grad.isfinite().all()
