"""Tests for the fast chunked KDA paths (openk3/ops/kda/chunk.py, chunk_bf16.py) against the references.

kda_chunked: fast ≡ tile reference ≡ recurrent (outputs, final states), every gradient of the hand-written backward
against fp64 autograd of the token loop (through kda_gate: dA_log, d dt_bias), ragged and packed inputs, saturated
gates at long lengths, bf16 inputs, the inverse against forward substitution, and the saved-memory contract of
backward. Its spec §6 bitwise tests live in test_kda.py.
kda_chunked_bf16 (bf16 tile operands): outputs, final states and every gradient within 1e-2 of fp64 autograd of the
token loop at the same bf16-rounded inputs (STYLE §5), ragged and packed inputs, saturated gates, the spec §6
bitwise tests (future perturbation, causal gradients, append, split at the 64-token state step), the compiled
elementwise kernel against its eager function, the block inverse, and the saved-memory contract.
Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import chunk, chunk_bf16, kda_chunked, kda_chunked_tiles, kda_gate, kda_recurrent
from openk3.ops.kda.chunk import _CHECKPOINT_TILES, lockstep_pays
from openk3.ops.kda.chunk_bf16 import kda_chunked_bf16
from openk3.utils import rel_rms

RAGGED = [1, 15, 16, 17, 63, 64, 65, 100, 1000]
PACKED_LENS = [[5, 16, 37], [1, 0, 64, 100, 17, 15, 65]]


@pytest.fixture(params=["stream", "lockstep"])
def layout(request, monkeypatch):
    """Packed sequences forced into one layout: one tile stream, or padded lockstep rows (chunk.lockstep_pays)."""
    monkeypatch.setattr(chunk, "_LOCKSTEP_MAX_WORK", 0.0 if request.param == "stream" else float("inf"))
    return request.param


def inputs(B, T, H=2, K=16, V=8, seed=0, dtype=torch.float32, g_value=None):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    g = kda_gate(2 * randn(B, T, H, K), 0.5 * randn(H), randn(H * K)) if g_value is None else torch.full(
        (B, T, H, K), g_value, dtype=dtype)  # fmt: skip
    return q, k, randn(B, T, H, V), g, torch.sigmoid(randn(B, T, H))


@pytest.mark.parametrize("T", RAGGED)
def test_fast_matches_tile_reference_and_recurrent(T):
    B, H, K, V = 2, 2, 32, 16
    x = inputs(B, T, H, K, V, seed=T)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(T + 1))
    o_rec, S_rec = kda_recurrent(*x, initial_state=h0, output_final_state=True)
    o_tile, S_tile = kda_chunked_tiles(*x, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(*x, initial_state=h0, output_final_state=True)
    for ref_o, ref_S in ((o_rec, S_rec), (o_tile, S_tile)):
        assert rel_rms(o, ref_o) <= 1e-5 and rel_rms(S, ref_S) <= 1e-5


def test_fast_matches_recurrent_fp64():
    """fp64 isolates algebra errors from rounding: the fast tile algebra must agree to ~1e-12."""
    x = inputs(2, 150, 2, 16, 8, seed=3, dtype=torch.float64)
    h0 = torch.randn(2, 2, 16, 8, dtype=torch.float64)
    o_rec, S_rec = kda_recurrent(*x, initial_state=h0, output_final_state=True)
    o, S = kda_chunked(*x, initial_state=h0, output_final_state=True)
    assert o.dtype == S.dtype == torch.float64
    assert rel_rms(o, o_rec) <= 1e-12 and rel_rms(S, S_rec) <= 1e-12


def grads_through_gate(op, leaves, cot_o, cot_S, dtype, **kwargs):
    x = {n: t.detach().to(dtype).requires_grad_() for n, t in leaves.items()}
    g = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"])
    g.retain_grad()
    o, S = op(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True, **kwargs)
    ((o * cot_o.to(dtype)).sum() + (S * cot_S.to(dtype)).sum()).backward()
    return {**{n: t.grad for n, t in x.items()}, "g": g.grad}


def gradient_leaves(B, T, H, K, V, seed, N=None):
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1),
        "v": torch.randn(B, T, H, V, generator=gen),
        "g_raw": 2 * torch.randn(B, T, H, K, generator=gen),
        "beta": torch.sigmoid(torch.randn(B, T, H, generator=gen)),
        "A_log": 0.5 * torch.randn(H, generator=gen),
        "dt_bias": torch.randn(H * K, generator=gen),
        "h0": torch.randn(N or B, H, K, V, generator=gen),
    }


@pytest.mark.parametrize("T", [1, 17, 64, 100, 300])
def test_hand_written_backward_matches_fp64_autograd_of_recurrent(T):
    B, H, K, V = 2, 2, 16, 8
    leaves = gradient_leaves(B, T, H, K, V, seed=10 + T)
    gen = torch.Generator().manual_seed(11)
    cot_o, cot_S = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    ref = grads_through_gate(kda_recurrent, leaves, cot_o, cot_S, torch.float64)
    fast = grads_through_gate(kda_chunked, leaves, cot_o, cot_S, torch.float32)
    assert set(ref) == {"q", "k", "v", "g_raw", "beta", "A_log", "dt_bias", "h0", "g"}
    for name in ref:
        assert fast[name].dtype == torch.float32, name
        assert rel_rms(fast[name], ref[name]) <= 1e-4, name
    fast64 = grads_through_gate(kda_chunked, leaves, cot_o, cot_S, torch.float64)
    for name in ref:
        assert rel_rms(fast64[name], ref[name]) <= 1e-10, name


def test_gradcheck_tiny_fp64():
    """Finite differences on a tiny fp64 problem spanning several tiles and a checkpoint boundary."""
    B, T, H, K, V = 1, 4 * 16 * _CHECKPOINT_TILES // 4 + 5, 1, 4, 3
    x = [t.double().requires_grad_() for t in inputs(B, T, H, K, V, seed=21)]
    h0 = torch.randn(B, H, K, V, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, g, beta, h0):
        return kda_chunked(q, k, v, g, beta, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(fn, (*x, h0), eps=1e-6, atol=1e-6, fast_mode=True)


def packed(seq_lens, H=2, K=16, V=8, seed=30):
    T = sum(seq_lens)
    x = inputs(1, T, H, K, V, seed=seed)
    h0 = torch.randn(len(seq_lens), H, K, V, generator=torch.Generator().manual_seed(seed + 1))
    cu_seqlens = torch.tensor([0] + seq_lens).cumsum(0)
    return x, h0, cu_seqlens


def assert_each_sequence_alone(op, x, h0, cu_seqlens, leaves, o, S, cot):
    """Each packed sequence run alone through `op` is bitwise the packed run: outputs, final states and every
    gradient. `leaves` are the packed call's inputs (q, k, v, g, beta, h0) after backward of (o·cot).sum() + S.sum()."""
    for n in range(len(cu_seqlens) - 1):
        tokens = slice(int(cu_seqlens[n]), int(cu_seqlens[n + 1]))
        alone = [t[:, tokens].clone().requires_grad_() for t in x] + [h0[n : n + 1].clone().requires_grad_()]
        o_n, S_n = op(*alone[:5], initial_state=alone[5], output_final_state=True)
        ((o_n.float() * cot[:, tokens]).sum() + S_n.sum()).backward()
        assert torch.equal(o[:, tokens], o_n) and torch.equal(S[n : n + 1], S_n), n
        for whole, part in zip(leaves[:5], alone[:5]):
            assert torch.equal(whole.grad[:, tokens], part.grad), n
        assert torch.equal(leaves[5].grad[n : n + 1], alone[5].grad), n


@pytest.mark.parametrize("seq_lens", PACKED_LENS)
def test_packed_is_bitwise_each_sequence_alone(seq_lens, layout, one_thread):
    """In either layout (one tile stream, or rows padded to the longest) each packed sequence is bitwise its own
    run (outputs, states, and every gradient), including an empty sequence (its final state is its initial state)."""
    x, h0, cu_seqlens = packed(seq_lens)
    leaves = [t.clone().requires_grad_() for t in (*x, h0)]
    o, S = kda_chunked(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens)
    cot = torch.randn_like(o)
    ((o * cot).sum() + S.sum()).backward()
    o_rec, S_rec = kda_recurrent(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    assert rel_rms(o, o_rec) <= 1e-5 and rel_rms(S, S_rec) <= 1e-5
    assert_each_sequence_alone(kda_chunked, x, h0, cu_seqlens, leaves, o, S, cot)
    if 0 in seq_lens:
        empty = seq_lens.index(0)
        assert torch.equal(S[empty], h0[empty]) and torch.equal(leaves[5].grad[empty], torch.ones_like(h0[empty]))


def test_lockstep_pays_only_for_several_sequences_of_similar_length():
    assert lockstep_pays([0, 100, 210, 300], 16)  # 7 + 7 + 6 tiles -> 3 x 7 = 21 <= 2 x 20
    assert not lockstep_pays([0, 300], 16)  # one sequence: the layouts are the same
    assert not lockstep_pays([0, 0, 300, 300], 16)  # one non-empty sequence among empty ones
    assert not lockstep_pays([0, 1000, 1010, 1020, 1030], 16)  # one long and three short: 4 x 63 > 2 x 66


@pytest.mark.parametrize("g_value", [None, -5.0])
def test_lockstep_and_stream_layouts_agree(g_value, monkeypatch):
    """The two layouts of one packed batch give the same outputs, final states and gradients (to rounding), at
    random and at saturated gates with large values."""
    seq_lens = [37, 100, 64, 1, 90]
    x, h0, cu_seqlens = packed(seq_lens)
    if g_value is not None:  # saturated gates, values 1e3 times larger
        x = list(inputs(1, sum(seq_lens), seed=30, g_value=g_value))
        x[2] = x[2] * 1e3
    assert lockstep_pays(cu_seqlens.tolist(), 16)
    results = []
    for max_work in (0.0, float("inf")):
        monkeypatch.setattr(chunk, "_LOCKSTEP_MAX_WORK", max_work)
        leaves = [t.clone().requires_grad_() for t in (*x, h0)]
        o, S = kda_chunked(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens)
        gen = torch.Generator().manual_seed(7)
        ((o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()).backward()
        results.append([o, S] + [t.grad for t in leaves])
    for stream, lockstep in zip(*results):
        assert torch.isfinite(lockstep).all() and rel_rms(lockstep, stream) <= 1e-6


def test_packed_gradients_match_recurrent(layout):
    x, h0, cu_seqlens = packed([7, 33, 64, 1])
    results = []
    for op in (kda_recurrent, kda_chunked):
        leaves = [t.clone().requires_grad_() for t in (*x, h0)]
        o, S = op(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens)
        gen = torch.Generator().manual_seed(5)
        ((o * torch.randn(o.shape, generator=gen)).sum() + (S * torch.randn(S.shape, generator=gen)).sum()).backward()
        results.append([t.grad for t in leaves])
    for rec, fast in zip(*results):
        assert rel_rms(fast, rec) <= 1e-4


@pytest.mark.parametrize("g_value", [-5.0, -4.999, 0.0])
def test_saturated_gates_finite_at_long_length(g_value):
    B, T, H, K, V = 1, 2048, 1, 16, 16
    x = [t.requires_grad_() for t in inputs(B, T, H, K, V, seed=40, g_value=g_value)]
    o, S = kda_chunked(*x, output_final_state=True)
    assert o.isfinite().all() and S.isfinite().all()
    (o.sum() + S.sum()).backward()
    for t in x:
        assert t.grad.isfinite().all()
    if g_value != 0.0:  # with no decay the long run is checked against the loop on a prefix instead
        o_rec, _ = kda_recurrent(*(t.detach()[:, :100] for t in x))
        assert rel_rms(o[:, :100], o_rec) <= 1e-5


def test_bf16_inputs_within_tolerance_and_dtypes():
    B, T, H, K, V = 2, 200, 2, 32, 16
    x = inputs(B, T, H, K, V, seed=50)
    h0 = torch.randn(B, H, K, V)
    o_ref, S_ref = kda_recurrent(*x, initial_state=h0, output_final_state=True)
    q, k, v, g, beta = x
    bf = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta]
    leaves = [t.clone().requires_grad_() for t in bf]
    o, S = kda_chunked(*leaves, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(S, S_ref) <= 1e-2
    o.float().sum().backward()
    assert [t.grad.dtype for t in leaves] == [t.dtype for t in bf]


def saved_bytes(T, H=2, K=16, V=8):
    """Bytes the autograd graph of one kda_chunked call keeps for backward (inputs included)."""
    x = [t.requires_grad_() for t in inputs(1, T, H, K, V, seed=70)]
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = kda_chunked(*x)
    input_bytes = sum(t.numel() * t.element_size() for t in x)
    return sum(seen.values()) - input_bytes, o


def test_backward_saves_only_inputs_and_checkpoint_states():
    """Beyond the inputs, the graph holds one fp32 state per 64 tokens: nothing per tile or per token."""
    H, K, V = 2, 16, 8
    state_bytes = H * K * V * 4
    for T in (64, 1000, 2000):
        extra, o = saved_bytes(T, H, K, V)
        tokens_per_state = 16 * _CHECKPOINT_TILES
        assert extra == -(-T // tokens_per_state) * state_bytes, T
        assert o.grad_fn is not None


def test_no_grad_and_grad_paths_agree_bitwise():
    x = inputs(1, 130, seed=80)
    with torch.no_grad():
        o_a, S_a = kda_chunked(*x, output_final_state=True)
    o_b, S_b = kda_chunked(*(t.clone().requires_grad_() for t in x), output_final_state=True)
    assert torch.equal(o_a, o_b.detach()) and torch.equal(S_a, S_b.detach())


# kda_chunked_bf16: bf16 tile operands, fp32 state (chunk_bf16.py)

BF16_LENGTHS = [1, 15, 17, 63, 64, 65, 100, 300]  # 300 tokens: two 256-token blocks, a partial last chunk


def bf16_inputs(B, T, H=2, K=32, V=16, seed=0, g_value=None):
    """Inputs with q, k, v rounded to bf16, plus the same values in fp64 for the reference."""
    q, k, v, g, beta = inputs(B, T, H, K, V, seed=seed, g_value=g_value)
    x_bf = [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta]
    return x_bf, [t.double() for t in x_bf]


# Tiles of 8 rows (block-doubling inverse) and 12 (row-by-row inverse: the non-power-of-two branch) besides 16.
@pytest.mark.parametrize(("T", "chunk_size"), [*((T, 16) for T in BF16_LENGTHS), (100, 8), (100, 12)])
def test_bf16_op_matches_fp64_recurrent(T, chunk_size):
    """Outputs and final states within 1e-2 (STYLE §5) of the token loop at the same bf16-rounded inputs."""
    B, H, K, V = 2, 2, 32, 16
    x_bf, x64 = bf16_inputs(B, T, H, K, V, seed=T)
    h0 = torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(T + 1))
    o, S = kda_chunked_bf16(*x_bf, initial_state=h0, output_final_state=True, chunk_size=chunk_size)
    o_ref, S_ref = kda_recurrent(*x64, initial_state=h0.double(), output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_rms(o, o_ref) <= 1e-2 and rel_rms(S, S_ref) <= 1e-2, (rel_rms(o, o_ref), rel_rms(S, S_ref))
    o_none, S_none = kda_chunked_bf16(*x_bf, initial_state=h0, chunk_size=chunk_size)
    assert S_none is None and torch.equal(o_none, o)


@pytest.mark.parametrize("T", [17, 100, 300])
def test_bf16_op_gradients_match_fp64_autograd_of_recurrent(T):
    """Every gradient (q, k, v, g_raw, beta, A_log, dt_bias, h0, g) within 1e-2 of fp64 autograd of the token loop
    at the same bf16-rounded q, k, v; gradients come back in the inputs' dtypes."""
    B, H, K, V = 2, 2, 32, 16
    leaves = gradient_leaves(B, T, H, K, V, seed=20 + T)
    for name in ("q", "k", "v"):
        leaves[name] = leaves[name].bfloat16()
    gen = torch.Generator().manual_seed(21)
    cot_o, cot_S = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    ref = grads_through_gate(kda_recurrent, leaves, cot_o, cot_S, torch.float64)
    x = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    g = kda_gate(x["g_raw"], x["A_log"], x["dt_bias"])
    g.retain_grad()
    o, S = kda_chunked_bf16(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"], output_final_state=True)
    ((o.float() * cot_o).sum() + (S * cot_S).sum()).backward()
    fast = {**{n: t.grad for n, t in x.items()}, "g": g.grad}
    for name in ref:
        assert fast[name].dtype == leaves.get(name, g).dtype, name
        assert rel_rms(fast[name], ref[name]) <= 1e-2, (name, rel_rms(fast[name], ref[name]))


@pytest.mark.parametrize("seq_lens", PACKED_LENS)
def test_bf16_op_packed_is_bitwise_each_sequence_alone(seq_lens, layout, one_thread):
    """Packed sequences start on 64-token chunks, so each is bitwise its own run (outputs, states, gradients), and
    every output is within 1e-2 of the token loop."""
    x, h0, cu_seqlens = packed(seq_lens, K=32, V=16)
    x = [t.bfloat16() if i < 3 else t for i, t in enumerate(x)]
    leaves = [t.clone().requires_grad_() for t in (*x, h0)]
    o, S = kda_chunked_bf16(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu_seqlens)
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(31))
    ((o.float() * cot).sum() + S.sum()).backward()
    o_rec, S_rec = kda_recurrent(*(t.double() for t in x), initial_state=h0.double(), output_final_state=True,
                                 cu_seqlens=cu_seqlens)  # fmt: skip
    assert rel_rms(o, o_rec) <= 1e-2 and rel_rms(S, S_rec) <= 1e-2
    assert_each_sequence_alone(kda_chunked_bf16, x, h0, cu_seqlens, leaves, o, S, cot)
    if 0 in seq_lens:
        empty = seq_lens.index(0)
        assert torch.equal(S[empty], h0[empty])


@pytest.mark.parametrize("g_value", [-5.0, -4.999, 0.0])
def test_bf16_op_saturated_gates_finite_at_long_length(g_value):
    B, T, H, K, V = 1, 2048, 1, 16, 16
    x_bf, x64 = bf16_inputs(B, T, H, K, V, seed=40, g_value=g_value)
    x = [t.requires_grad_() for t in x_bf]
    o, S = kda_chunked_bf16(*x, output_final_state=True)
    assert o.isfinite().all() and S.isfinite().all()
    (o.float().sum() + S.sum()).backward()
    for t in x:
        assert t.grad.isfinite().all()
    o_rec, S_rec = kda_recurrent(*(t[:, :300] for t in x64), output_final_state=True)
    o_pre, S_pre = kda_chunked_bf16(*(t.detach()[:, :300] for t in x), output_final_state=True)
    assert rel_rms(o_pre, o_rec) <= 1e-2 and rel_rms(S_pre, S_rec) <= 1e-2


def perturb_after(x_bf, P, seed):
    """The inputs with every token at position >= P replaced by fresh values (saturated gates among them)."""
    fresh, _ = bf16_inputs(x_bf[0].shape[0], x_bf[0].shape[1], *x_bf[0].shape[2:3], x_bf[0].shape[3],
                           x_bf[2].shape[3], seed=seed)  # fmt: skip
    fresh[3][:, P::3] = -5.0
    out = []
    for a, b in zip(x_bf, fresh):
        y = a.clone()
        y[:, P:] = b[:, P:]
        out.append(y)
    return out


@pytest.mark.parametrize("T", [15, 17, 100, 300])
def test_bf16_op_future_perturbation_and_causal_gradients(T, one_thread):
    """Spec §6 tests 1 and 2: outputs and gradients before P are bitwise independent of inputs at and after P."""
    x_bf, _ = bf16_inputs(1, T, seed=70 + T)
    h0 = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(71))
    cot = torch.randn(1, T, 2, 16, generator=torch.Generator().manual_seed(72))

    def run(x, P):
        leaves = [t.clone().requires_grad_() for t in x]
        o, _ = kda_chunked_bf16(*leaves, initial_state=h0)
        (o[:, :P].float() * cot[:, :P]).sum().backward()
        return o.detach(), [t.grad for t in leaves]

    for P in sorted({1, 15, 16, 17, 37, 64, T - 1} & set(range(1, T))):
        o, grads = run(x_bf, P)
        o_p, grads_p = run(perturb_after(x_bf, P, seed=P), P)
        assert torch.equal(o[:, :P], o_p[:, :P]), P
        for a, b in zip(grads, grads_p):
            assert torch.equal(a[:, :P], b[:, :P]), P
            assert (a[:, P:] == 0).all() and (b[:, P:] == 0).all(), P


@pytest.mark.parametrize("T", [63, 100, 300])
def test_bf16_op_append_and_split(T, one_thread):
    """Spec §6 tests 3 and 4: a truncated run is bitwise a prefix of the full run; splitting with the state handed
    over is bitwise at multiples of the 64-token state step and within 1e-2 elsewhere."""
    x_bf, _ = bf16_inputs(2, T, seed=80 + T)
    h0 = torch.randn(2, 2, 32, 16, generator=torch.Generator().manual_seed(81))
    o_full, S_full = kda_chunked_bf16(*x_bf, initial_state=h0, output_final_state=True)
    for P in sorted({1, 15, 16, 17, 37, 64, 128, T - 1} & set(range(1, T))):
        o_a, S_a = kda_chunked_bf16(*(t[:, :P] for t in x_bf), initial_state=h0, output_final_state=True)
        assert torch.equal(o_a, o_full[:, :P]), P
        o_b, S_b = kda_chunked_bf16(*(t[:, P:] for t in x_bf), initial_state=S_a, output_final_state=True)
        o_split = torch.cat([o_a, o_b], dim=1)
        if P % (16 * chunk_bf16.STATE_TILES) == 0:
            assert torch.equal(o_split, o_full) and torch.equal(S_b, S_full), P
        else:
            assert rel_rms(o_split, o_full) <= 1e-2 and rel_rms(S_b, S_full) <= 1e-2, P


def test_bf16_compiled_operands_match_eager(monkeypatch):
    """The compiled elementwise kernel ≡ its eager function to one bf16 rounding (it may contract a*b+c), and the
    op still runs (and agrees) when compiling is unavailable and the eager fallback is used."""
    x_bf, _ = bf16_inputs(1, 300, seed=90)
    o, S = kda_chunked_bf16(*x_bf, output_final_state=True)
    S_, nc, R, C, K = 4, 2, 3, 16, 32
    gen = torch.Generator().manual_seed(91)
    q, k = (F.normalize(torch.randn(S_, nc, R, C, K, generator=gen), dim=-1).bfloat16() for _ in range(2))
    G = (-5 * torch.rand(S_, nc, R, C, K, generator=gen)).cumsum(-2)
    Dpre, Dpost = torch.rand(2, S_, nc, R, 1, K, generator=gen)
    outs = [tuple(torch.empty(7, S_, nc, R, C, K, dtype=torch.bfloat16)) for _ in range(2)]
    chunk_bf16.anchored_operands(q, k, G, Dpre, Dpost, 0.2, outs[0])
    chunk_bf16.compiled_operands(q, k, G, Dpre, Dpost, 0.2, outs[1])
    for eager, compiled in zip(*outs):
        assert ((eager.float() - compiled.float()).abs() <= 2**-7 * eager.float().abs()).all()
    monkeypatch.setattr(chunk_bf16.compiled_operands, "fn", chunk_bf16.anchored_operands)
    o_eager, S_eager = kda_chunked_bf16(*x_bf, output_final_state=True)
    assert rel_rms(o_eager, o) <= 1e-2 and rel_rms(S_eager, S) <= 1e-2


def test_bf16_op_rejects_other_dtypes_and_saves_only_checkpoints():
    x_bf, _ = bf16_inputs(1, 100, seed=95)
    with pytest.raises(ValueError, match="bf16 q, k, v"):
        kda_chunked_bf16(x_bf[0].float(), *x_bf[1:])
    leaves = [t.requires_grad_() for t in x_bf]
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kda_chunked_bf16(*leaves)
    extra = sum(seen.values()) - sum(t.numel() * t.element_size() for t in leaves)
    assert extra == -(-100 // (16 * _CHECKPOINT_TILES)) * 2 * 32 * 16 * 4


def test_dispatch_bf16_impl_is_opt_in_and_routes_by_dtype(monkeypatch):
    """`use_impl("kda_chunked", "bf16")` runs kda_chunked_bf16 for bf16 inputs on a CPU with bf16 arithmetic (here
    one said to have it; without it the fp32-compute op runs: tests/ops/test_widen.py) and the fp32-compute op
    otherwise; without it the dispatcher never picks it."""
    from openk3.ops import dispatch
    from openk3.ops.cpu_features import CPUFeatures

    monkeypatch.setattr(dispatch, "features", lambda: CPUFeatures("x86_64", frozenset({"avx512f", "avx512_bf16"})))
    assert dispatch.select("kda_chunked", torch.device("cpu")) == "ref"
    x_bf, _ = bf16_inputs(1, 80, seed=3)
    h0 = torch.randn(1, 2, 32, 16)
    with dispatch.use_impl("kda_chunked", "bf16"):
        o, S = dispatch.kda_chunked(*x_bf, initial_state=h0, output_final_state=True)
        x32 = [t.float() for t in x_bf]
        o32, S32 = dispatch.kda_chunked(*x32, initial_state=h0, output_final_state=True)
    o_ref, S_ref = kda_chunked_bf16(*x_bf, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(S, S_ref)
    o_fp, S_fp = kda_chunked(*x32, initial_state=h0, output_final_state=True)
    assert torch.equal(o32, o_fp) and torch.equal(S32, S_fp)
