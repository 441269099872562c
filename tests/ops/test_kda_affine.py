"""Tests for openk3.ops.kda.affine: per-segment affine summaries reproduce the one-pass run (spec/kda.md §9).

Composition of per-segment (M, S_ext) in order gives the one-pass final state; re-running each segment from its
recovered entry state gives the one-pass outputs; chain and tree bracketing agree. Within tolerance (§9.4).
Shapes: B batch, T tokens, H heads, K key dim, V value dim.
"""

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import compose_summaries, entry_states, kda_chunked, kda_gate, kda_segment_summary
from openk3.utils import rel_rms


def inputs(B, T, H=2, K=16, V=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = F.normalize(randn(B, T, H, K), dim=-1), F.normalize(randn(B, T, H, K), dim=-1)
    g = kda_gate(randn(B, T, H, K), 0.5 * randn(H), randn(H * K))
    return q, k, randn(B, T, H, V), g, torch.sigmoid(randn(B, T, H))


@pytest.mark.parametrize("cuts", [[64, 192], [37, 100, 101], [16]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_composed_summaries_reproduce_one_pass(cuts, dtype):
    B, T, H, K, V = 2, 250, 2, 16, 8
    x = inputs(B, T, H, K, V, seed=sum(cuts), dtype=dtype)
    h0 = torch.randn(B, H, K, V, dtype=dtype)
    o_full, S_full = kda_chunked(*x, initial_state=h0, output_final_state=True)
    bounds = [0, *cuts, T]
    segments = [tuple(t[:, a:b] for t in x) for a, b in zip(bounds, bounds[1:])]
    summaries = [kda_segment_summary(*seg) for seg in segments]
    assert summaries[0][0].shape == (B, H, K, K) and summaries[0][1].shape == (B, H, K, V)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    M, S_ext = compose_summaries(summaries)
    assert rel_rms(M @ h0 + S_ext, S_full) <= tol
    # Tree bracketing (what a log-depth scan would do) gives the same map.
    if len(summaries) >= 3:
        left = compose_summaries(summaries[:2])
        M_tree, S_tree = compose_summaries([left, compose_summaries(summaries[2:])])
        assert rel_rms(M_tree, M) <= tol and rel_rms(S_tree, S_ext) <= tol
    states = entry_states(summaries, h0)
    assert rel_rms(states[-1], S_full) <= tol
    outputs = []
    for seg, S_in in zip(segments, states):
        o_seg, _S_out = kda_chunked(*seg, initial_state=S_in, output_final_state=True)
        outputs.append(o_seg)
    assert rel_rms(torch.cat(outputs, 1), o_full) <= tol


def test_summary_of_packed_sequences_matches_each_alone():
    seq_lens = [20, 64, 33]
    x = inputs(1, sum(seq_lens), seed=5)
    cu_seqlens = torch.tensor([0] + seq_lens).cumsum(0)
    M, S_ext = kda_segment_summary(*x, cu_seqlens=cu_seqlens)
    assert M.shape[0] == len(seq_lens)
    for n in range(len(seq_lens)):
        tokens = slice(int(cu_seqlens[n]), int(cu_seqlens[n + 1]))
        M_n, S_n = kda_segment_summary(*(t[:, tokens] for t in x))
        assert torch.allclose(M[n : n + 1], M_n, atol=1e-6) and torch.allclose(S_ext[n : n + 1], S_n, atol=1e-6)


def test_transition_is_identity_for_neutral_tokens():
    """k = 0 and g = 0 rows (right padding) leave the state untouched: M = I and S_ext = 0 exactly."""
    B, T, H, K, V = 1, 40, 2, 8, 4
    zeros = torch.zeros(B, T, H, K)
    M, S_ext = kda_segment_summary(zeros, zeros, torch.zeros(B, T, H, V), zeros, torch.zeros(B, T, H))
    assert torch.equal(M, torch.eye(K).expand(B, H, K, K)) and torch.equal(S_ext, torch.zeros(B, H, K, V))
