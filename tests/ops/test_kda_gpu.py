"""Tests for the GPU path (openk3/ops/kda/gpu.py) and the dispatch point (openk3/ops/dispatch.py).

The fla-core comparisons run only with CUDA + triton + fla-core (skipped elsewhere); the dispatch tests run on CPU.
Tolerances: bf16 kernels vs the fp32 reference ≤ 5e-3 for o, ≤ 1e-2 for states and gradients (spec §7).
Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences.
"""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import dispatch
from openk3.ops.kda import kda_chunked, kda_gate, kda_recurrent, kda_step
from openk3.ops.kda.gpu import fla_available
from openk3.utils import rel_rms

needs_fla = pytest.mark.skipif(not fla_available(), reason="needs CUDA, triton and fla-core (openk3[gpu])")


def inputs(B, T, H=4, K=64, V=64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    g = kda_gate(2 * torch.randn(B, T, H, K, generator=gen), torch.zeros(H), torch.randn(H * K, generator=gen))
    x = (q, k, torch.randn(B, T, H, V, generator=gen), g, torch.sigmoid(torch.randn(B, T, H, generator=gen)))
    return tuple(t.to(device) for t in x)


def test_dispatch_picks_ref_on_cpu_and_can_be_forced():
    x = inputs(1, 40, 2, 16, 8)
    assert dispatch.select("kda_chunked", torch.device("cpu")) == "ref"
    o, _ = dispatch.kda_chunked(*x)
    assert torch.equal(o, kda_chunked(*x)[0])
    with dispatch.use_impl("kda_chunked", "fla"):
        assert dispatch.select("kda_chunked", torch.device("cpu")) == "fla"
    assert dispatch.select("kda_chunked", torch.device("cpu")) == "ref"
    with pytest.raises(ValueError, match="unknown implementation"), dispatch.use_impl("kda_chunked", "cuda"):
        pass
    state = torch.randn(1, 2, 16, 8)
    o_t, S_t = dispatch.kda_step(*(t[:, 0] for t in x), state)
    o_r, S_r = kda_step(*(t[:, 0] for t in x), state)
    assert torch.equal(o_t, o_r) and torch.equal(S_t, S_r)


@needs_fla
@pytest.mark.parametrize("T", [1, 63, 1000])
def test_fla_chunk_matches_reference(T):
    B, H, K, V = 2, 4, 64, 64
    x = inputs(B, T, H, K, V, seed=T)
    h0 = torch.randn(B, H, K, V)
    o_ref, S_ref = kda_recurrent(*x, initial_state=h0, output_final_state=True)
    xg = [t.cuda().requires_grad_() for t in x]
    xg[0].data, xg[1].data, xg[2].data = (t.data.bfloat16() for t in xg[:3])
    h0g = h0.cuda().requires_grad_()
    with dispatch.use_impl("kda_chunked", "fla"):
        o, S = dispatch.kda_chunked(*xg, initial_state=h0g, output_final_state=True)
    assert S.dtype == torch.float32
    assert rel_rms(o.float().cpu(), o_ref) <= 5e-3 and rel_rms(S.cpu(), S_ref) <= 1e-2
    # Gradients against the fp32 CPU fast path (itself checked against fp64 autograd of the loop).
    gen = torch.Generator().manual_seed(1)
    cot_o, cot_S = torch.randn(o.shape, generator=gen), torch.randn(S.shape, generator=gen)
    ((o.float() * cot_o.cuda()).sum() + (S * cot_S.cuda()).sum()).backward()
    xc = [t.clone().requires_grad_() for t in x]
    h0c = h0.clone().requires_grad_()
    o_c, S_c = kda_chunked(*xc, initial_state=h0c, output_final_state=True)
    ((o_c * cot_o).sum() + (S_c * cot_S).sum()).backward()
    for a, b in zip([*xg, h0g], [*xc, h0c]):
        assert rel_rms(a.grad.float().cpu(), b.grad) <= 1e-2


@needs_fla
def test_fla_chunk_packed_and_step():
    seq_lens = [5, 100, 64]
    x = inputs(1, sum(seq_lens), seed=3)
    cu_seqlens = torch.tensor([0] + seq_lens).cumsum(0)
    h0 = torch.randn(3, 4, 64, 64)
    o_ref, S_ref = kda_recurrent(*x, initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)
    with dispatch.use_impl("kda_chunked", "fla"), dispatch.use_impl("kda_step", "fla"):
        o, S = dispatch.kda_chunked(*(t.cuda() for t in x), initial_state=h0.cuda(), output_final_state=True,
                                    cu_seqlens=cu_seqlens.cuda())  # fmt: skip
        assert rel_rms(o.cpu(), o_ref) <= 1e-4 and rel_rms(S.cpu(), S_ref) <= 1e-4
        y = inputs(2, 1, seed=4)
        state = torch.randn(2, 4, 64, 64)
        state_gpu = state.cuda()
        o_t, S_t = dispatch.kda_step(*(t[:, 0].cuda() for t in y), state_gpu)
        assert torch.equal(state_gpu.cpu(), state), "the decode step must not write its input state"
    o_r, S_r = kda_step(*(t[:, 0] for t in y), state)
    assert rel_rms(o_t.cpu(), o_r) <= 1e-4 and rel_rms(S_t.cpu(), S_r) <= 1e-4
