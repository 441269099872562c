"""The batched sampler against its per-row reference: identical probabilities (bitwise) and identical tokens, with
every row's generator left in the same state, on random rows with per-row settings, ties and extreme logits."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.sampling import draw, ref_sample_rows, sample_rows, sampling_probs, sampling_probs_rows


def _settings(n: int, seed: int, V: int):
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (), generator=g))]
    temperature = [pick([0.0, 1e-6, 1e-5, 0.3, 0.8, 1.0, 1.7]) for _ in range(n)]
    top_k = [pick([0, 1, 2, 5, V - 1, V, V + 10]) for _ in range(n)]
    top_p = [pick([1.0, 0.9, 0.5, 0.1, 1e-30]) for _ in range(n)]
    return temperature, top_k, top_p


def _logits(n: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 4
    x[0, :] = 0.0  # a row of ties
    if n > 1:
        x[1, : V // 2] = 7.0  # half the row tied at the top
    if n > 2:
        x[2] *= 1e4  # extreme logits
    if n > 3:
        x[3] = x[3].round()  # many ties among the ranks
    return x


@pytest.mark.parametrize("n, V, seed", [(1, 7, 0), (5, 16, 1), (17, 100, 2), (40, 1024, 3), (9, 4001, 4)])
def test_sample_rows_matches_the_per_row_reference(n, V, seed):
    logits = _logits(n, V, seed)
    temperature, top_k, top_p = _settings(n, seed, V)
    gens_a = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    gens_b = [torch.Generator().manual_seed(100 + i) for i in range(n)]
    for _ in range(3):  # several draws: the generators must advance identically
        got = sample_rows(logits, temperature, top_k, top_p, gens_a)
        want = ref_sample_rows(logits, temperature, top_k, top_p, gens_b)
        assert torch.equal(got, want)
    for a, b in zip(gens_a, gens_b):
        assert torch.equal(a.get_state(), b.get_state())
    sampled = [i for i, t in enumerate(temperature) if t >= 1e-5]
    if sampled:
        probs = sampling_probs_rows(logits[sampled], [temperature[i] for i in sampled], [top_k[i] for i in sampled],
                                    [top_p[i] for i in sampled])  # fmt: skip
        for row, i in enumerate(sampled):
            assert torch.equal(probs[row], sampling_probs(logits[i], temperature[i], top_k[i], top_p[i]))


def test_a_row_does_not_depend_on_its_batch():
    """The same row with the same generator state draws the same token alone and among other rows."""
    V = 300
    logits = torch.randn(12, V, generator=torch.Generator().manual_seed(5))
    temperature, top_k, top_p = [1.0] * 12, [0, 50] * 6, [0.9, 1.0, 0.7] * 4
    alone = [int(sample_rows(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1],
                             [torch.Generator().manual_seed(i)])) for i in range(12)]  # fmt: skip
    batched = sample_rows(logits, temperature, top_k, top_p, [torch.Generator().manual_seed(i) for i in range(12)])
    assert batched.tolist() == alone
    assert len(set(alone)) > 3  # the rows really were sampled


def test_draw_is_torch_multinomial():
    """`draw` consumes a generator as torch.multinomial(p, 1) does and picks the same token (zeros included)."""
    g = torch.Generator().manual_seed(0)
    for V in (1, 2, 15, 16, 17, 800, 5000):
        for trial in range(6):
            p = torch.softmax(torch.randn(V, generator=g) * 3, 0)
            if trial % 2:
                p = p * (torch.rand(V, generator=g) < 0.5)
                p[0] += 1e-3
            ga, gb = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            got = [int(draw(p[None], [ga])) for _ in range(4)]
            want = [int(torch.multinomial(p, 1, generator=gb)) for _ in range(4)]
            assert got == want and torch.equal(ga.get_state(), gb.get_state())


def test_sampled_rows_validate_their_settings():
    logits = torch.randn(2, 10)
    for bad in ([0.5, float("nan")], [0.5, -1.0], [0.0, 1.0]):
        with pytest.raises(ValueError):
            sampling_probs_rows(logits, bad, [0, 0], [1.0, 1.0])
    with pytest.raises(ValueError):
        sampling_probs_rows(logits, [1.0, 1.0], [0, -1], [1.0, 1.0])
    with pytest.raises(ValueError):
        sampling_probs_rows(logits, [1.0, 1.0], [0, 0], [1.0, 0.0])
