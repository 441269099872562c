"""The fused decode kernels of whole layer parts (ops/cpu_kernels: `KDADecode`, `MixNorm`, `MoEDecode`,
`MLADecode`) against their torch references (the torch decode paths of model/kda.py, model/moe.py and
model/mla.py; norm(attnres.mix(...))), on random weights, ragged sizes, several sequences, extreme values, fp32 and
bf16; the in-place update of serving's pools equals the fresh-output one; the dispatch falls back where a kernel does not apply;
a kernel prepared for a module's weights is rebuilt when they are replaced, moved or cast (cpu_kernels.packs).
The engine-level equivalence (prefix hits, speculative verify + fold, mixed chunks, preemption) is in
tests/serve/test_decode_kernels_engine.py."""

from __future__ import annotations

import pytest
import torch
from kernel_marks import needs_kernels

from openk3.config import K3Config
from openk3.model.attnres import mix, mix_norm
from openk3.model.batch import ForwardBatch, Mode
from openk3.model.cache import KDAInOut, KDAState, MLACache
from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import RMSNorm
from openk3.model.mla import GatedMLA
from openk3.model.moe import StableLatentMoE
from openk3.ops import cpu_kernels, dispatch
from openk3.ops.cpu_kernels import packs
from openk3.utils import rel_rms

pytestmark = needs_kernels

DTYPES = [torch.float32, torch.bfloat16]


torch_path = dispatch.reference_path


def _randomize(module: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 else 0.0))


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: only summation orders differ, so relative RMS <= 1e-5 and every element within 1e-4 of the largest
    (sums that cancel lose relative precision). bf16: the same roundings at the same places, so equal but for
    last-bit flips where an fp32 sum rounds the other way; those stay within two bf16 ulps."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        assert rel_rms(out, ref) <= 1e-5
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
    else:
        diff = (out.float() - ref.float()).abs()
        assert (diff <= ref.float().abs() * 2**-6 + 1e-2).all()
        assert (diff == 0).float().mean() > 0.8


# ---- KDA decode ------------------------------------------------------------------------------------------------


def _kda(dtype, seed=0):
    config = K3Config.preset("tiny").text_config
    layer = KimiDeltaAttention(config)
    _randomize(layer, seed)
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(layer.A_log.shape, generator=torch.Generator().manual_seed(seed + 1)))
    for name, p in layer.named_parameters():  # the release keeps these fp32
        p.data = (
            p.data.float()
            if name.endswith(("A_log", "dt_bias", "conv1d.weight", "o_norm.weight"))
            else p.data.to(dtype)
        )
    return layer.requires_grad_(False)


def _kda_cache(layer, N, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    P, H, K = layer.num_heads * layer.head_dim, layer.num_heads, layer.head_dim
    W = layer.q_conv1d.weight.shape[-1]
    tails = [(torch.randn(N, W - 1, P, generator=g) * scale).to(dtype) for _ in range(3)]
    state = torch.randn(N, H, K, K, generator=g) * 0.1 * scale
    return KDAState(*tails, state)


def _decode(layer, x, cache):
    batch = ForwardBatch.from_lengths(
        torch.zeros(x.shape[0], dtype=torch.long), [1] * x.shape[0], cache=_Cache(x.shape[0])
    )
    assert batch.mode is Mode.DECODE
    with torch.no_grad():
        return layer(x, batch, cache)


class _Cache:
    """The smallest K3Cache stand-in a DECODE ForwardBatch accepts (the layer gets its entry directly)."""

    def __init__(self, num_seqs: int):
        self.num_seqs = num_seqs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3])
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: saturated sigmoids in the gate, beta and the conv's SiLU
def test_kda_decode_equals_the_torch_path(dtype, N, scale):
    layer = _kda(dtype, seed=N)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(N, layer.q_proj.weight.shape[1], generator=g) * scale).to(dtype)
    ours, ref = _kda_cache(layer, N, dtype, 3, scale), _kda_cache(layer, N, dtype, 3, scale)
    held = ours.recurrent_NHKV  # a caller's reference from before the step keeps its value
    before = held.clone()
    out = _decode(layer, x, ours)
    with torch_path():
        expected = _decode(layer, x, ref)
    assert torch.equal(held, before) and ours.recurrent_NHKV is not held
    _close(out, expected, dtype)
    for a, b in zip(ours.load()[0], ref.load()[0]):  # the new tails: two shifted rows and this token's projection
        assert torch.equal(a[:, :-1], b[:, :-1])
        _close(a[:, -1], b[:, -1], dtype)
    assert rel_rms(ours.recurrent_NHKV, ref.recurrent_NHKV) <= 1e-5
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kda_decode_in_place_on_pool_rows_equals_fresh_outputs(dtype):
    """Serving's view hands the kernel the pools and the batch's slots (in place); the result equals the fresh
    outputs of the contiguous cache, and the other slots are untouched."""
    layer = _kda(dtype, seed=5)
    N, S = 2, 4
    slots = [3, 1]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N, layer.q_proj.weight.shape[1], generator=g).to(dtype)
    pool = _kda_cache(layer, S, dtype, 13)
    tails_pool = tuple(t.clone() for t in pool.load()[0])
    state_pool = pool.recurrent_NHKV.clone()
    contiguous = KDAState(*(t[slots].clone() for t in tails_pool), state_pool[slots].clone())
    _decode(layer, x, contiguous)

    class PoolView:
        def decode_in_out(self):
            return KDAInOut(tails_pool, state_pool, slots, tails_pool, state_pool, slots, lambda: None)

    before = state_pool.clone(), tuple(t.clone() for t in tails_pool)
    out = layer._decode_fused(x, PoolView())
    assert out is not None
    expected = _decode(layer, x, KDAState(*(t[slots].clone() for t in before[1]), before[0][slots].clone()))
    assert torch.equal(out, expected)
    assert torch.equal(state_pool[slots], contiguous.recurrent_NHKV)
    for pooled, fresh in zip(tails_pool, contiguous.load()[0]):
        assert torch.equal(pooled[slots], fresh)
    for s in (0, 2):
        assert torch.equal(state_pool[s], before[0][s])
        assert all(torch.equal(t[s], b[s]) for t, b in zip(tails_pool, before[1]))


def test_kda_decode_falls_back_where_it_does_not_apply():
    layer = _kda(torch.float32)
    cache = _kda_cache(layer, 1, torch.float32, 0)
    x = torch.randn(1, layer.q_proj.weight.shape[1])
    assert layer._decode_fused(x, cache) is not None
    cache = _kda_cache(layer, 1, torch.float32, 0)
    assert layer._decode_fused(x.bfloat16(), cache) is None  # activations in another dtype than the weights
    layer.requires_grad_(True)
    with torch.enable_grad():
        assert layer._decode_fused(x, cache) is None  # autograd needs the torch path
    with dispatch.use_impl("kda_decode", "ref"), torch.no_grad():
        assert layer._decode_fused(x, cache) is None


# ---- AttnRes mix + norm ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sources", [1, 2, 5])
@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("scale", [1.0, 1e3])  # 1e3: a softmax saturated on one source
def test_mix_norm_equals_norm_of_mix(dtype, sources, T, scale, calls):
    D = 96
    g = torch.Generator().manual_seed(sources * 10 + T)
    bank = [(torch.randn(T, D, generator=g) * scale).to(dtype) for _ in range(sources - 1)]
    partial = (torch.randn(T, D, generator=g) * scale).to(dtype)
    res_norm, out_norm, proj = RMSNorm(D, 1e-6), RMSNorm(D, 1e-5), torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        res_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        out_norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))
        proj.weight.copy_(torch.randn(1, D, generator=g) / D**0.5 * (30 if scale > 1 else 1))
    for m in (res_norm, out_norm, proj):
        m.to(dtype).requires_grad_(False)
    with torch.no_grad():
        out = mix_norm(bank, partial, res_norm, proj, out_norm)
        ref = out_norm(mix(bank, partial, res_norm, proj))
        assert calls == {"openk3_mix_norm": 1}
    _close(out, ref, dtype)
    with torch.no_grad():  # without the norm, the mix itself; an empty bank gives the partial sum exactly
        mixed = cpu_kernels.MixNorm(res_norm.weight, proj.weight, res_norm.eps, None, 0.0)([*bank, partial])
        _close(mixed, mix(bank, partial, res_norm, proj), dtype)
    if sources == 1:
        assert torch.equal(mixed, partial)


def test_mix_norm_falls_back_for_autograd_and_many_rows(calls):
    D = 32
    norm, proj = RMSNorm(D, 1e-6), torch.nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        norm.weight.fill_(1.0)
    p = torch.randn(9, D)
    bank = [torch.randn(2, D)]
    mix_norm([p[:2]], p[:2], norm, proj, norm)  # autograd on
    with torch.no_grad():
        mix_norm([p], p, norm, proj, norm)  # 9 > MAX_ROWS
        mix_norm([p[:2].bfloat16()], p[:2], norm, proj, norm)  # sources of two dtypes
        assert calls == {}
        mix_norm(bank, p[:2], norm, proj, norm)
        assert calls == {"openk3_mix_norm": 1}


# ---- MoE decode ------------------------------------------------------------------------------------------------


def _moe(dtype, shared: bool, seed=0):
    config = K3Config.preset("tiny").text_config
    if not shared:
        config.num_shared_experts = 0
    moe = StableLatentMoE(config)
    _randomize(moe, seed, scale=0.5)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(0.05 * torch.randn(moe.gate.e_score_correction_bias.shape))
    for name, p in moe.named_parameters():
        p.data = p.data.float() if name.endswith("e_score_correction_bias") else p.data.to(dtype)
    return moe.requires_grad_(False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("scale", [1.0, 20.0])  # 20: the SiTU caps reached
def test_moe_decode_equals_the_torch_path(dtype, shared, T, scale):
    moe = _moe(dtype, shared, seed=T)
    g = torch.Generator().manual_seed(T + 100)
    x = (torch.randn(T, moe.gate.weight.shape[1], generator=g) * scale).to(dtype)
    with torch.no_grad():
        out = moe(x)
        with torch_path():
            ref = moe(x)
    _close(out, ref, dtype)
    with torch.no_grad():
        assert moe._decode_fused(x, None) is not None


def test_moe_decode_routes_as_the_torch_router_and_breaks_ties_to_the_lower_id():
    moe = _moe(torch.float32, True)
    seen = []
    moe.observer = lambda module, scores, idx: seen.append((scores.clone(), idx.clone()))
    x = torch.randn(5, moe.gate.weight.shape[1]) * 3
    with torch.no_grad():
        moe(x)
        with torch_path():
            moe(x)
    (scores, idx), (ref_scores, ref_idx) = seen
    assert torch.equal(idx, ref_idx) and idx.dtype == torch.int64
    assert rel_rms(scores, ref_scores) <= 1e-6
    # Exact ties: two experts with the same router row and bias; the lower id is taken.
    E = moe.gate.weight.shape[0]
    with torch.no_grad():
        moe.gate.weight[1] = moe.gate.weight[0]
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.weight[2:] = -1.0 * moe.gate.weight[0]  # experts 0 and 1 on top for x ~ W[0]
        seen.clear()
        moe(moe.gate.weight[0:1].clone())
    # Experts 0 and 1 tie on top, experts 2.. tie below them: the k lowest ids win.
    assert E > moe.top_k and seen[0][1][0].tolist() == list(range(moe.top_k))


def test_moe_decode_replays_routes_and_feeds_the_observer():
    moe = _moe(torch.float32, True)
    seen = []
    moe.observer = lambda module, scores, idx: seen.append(idx.clone())
    x = torch.randn(2, moe.gate.weight.shape[1])
    E = moe.gate.weight.shape[0]
    routes = torch.stack([torch.randperm(E)[: moe.top_k] for _ in range(2)])
    with torch.no_grad():
        out = moe(x, routes)
        with torch_path():
            ref = moe(x, routes)
    _close(out, ref, torch.float32)
    assert len(seen) == 2 and torch.equal(seen[0], routes.sort(-1).values) and torch.equal(seen[0], seen[1])


def test_moe_decode_falls_back_and_checks_replayed_routes():
    moe = _moe(torch.float32, True)
    x = torch.randn(1, moe.gate.weight.shape[1])
    moe.requires_grad_(True)
    with torch.enable_grad():
        assert moe._decode_fused(x, None) is None  # training
    with torch.no_grad():
        assert moe._decode_fused(x, None) is not None
        assert moe._decode_fused(x.bfloat16(), None) is None  # dtype mismatch
        assert moe._decode_fused(torch.randn(9, x.shape[1]), None) is None  # more than MAX_ROWS tokens
        with dispatch.use_impl("moe_decode", "ref"):
            assert moe._decode_fused(x, None) is None
        E, k = moe.gate.weight.shape[0], moe.top_k
        with pytest.raises(ValueError, match="distinct ids"):
            moe._decode_fused(x, torch.tensor([[E] + list(range(k - 1))]))  # out of range
        if k > 1:
            with pytest.raises(ValueError, match="distinct ids"):
                moe._decode_fused(x, torch.tensor([[0] * k]))  # repeated


# ---- MLA decode ------------------------------------------------------------------------------------------------


def _mla(dtype, seed=0):
    layer = GatedMLA(K3Config.preset("tiny").text_config)
    _randomize(layer, seed)
    return layer.to(dtype).requires_grad_(False)


def _mla_cache(layer, lengths, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    R = layer.kv_rank + layer.rope
    return MLACache([(torch.randn(n, R, generator=g) * scale).to(dtype) for n in lengths])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lengths", [[4], [5, 1, 9]])  # ragged: the block pads the shorter sequences
@pytest.mark.parametrize("scale", [1.0, 30.0])  # 30: a softmax saturated on one position
def test_mla_decode_equals_the_torch_path(dtype, lengths, scale, calls):
    layer = _mla(dtype, seed=len(lengths))
    N = len(lengths)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(N, layer.q_a_proj.weight.shape[1], generator=g) * scale).to(dtype)
    ours, ref = _mla_cache(layer, lengths, dtype, 6, scale), _mla_cache(layer, lengths, dtype, 6, scale)
    batch = ForwardBatch.from_lengths(torch.zeros(N, dtype=torch.long), [1] * N, cache=_Cache(N))
    with torch.no_grad():
        out = layer(x, batch, ours)
        with torch_path():
            expected = layer(x, batch, ref)
    _close(out, expected, dtype)
    assert calls == {"openk3_mla_decode_in": 1, "openk3_mla_decode_out": 1}
    for a, b, n in zip(ours.latents, ref.latents, lengths):  # the new latent appended, the old ones untouched
        assert a.shape == b.shape == (n + 1, layer.kv_rank + layer.rope)
        assert torch.equal(a[:n], b[:n])
        _close(a[n:], b[n:], dtype)


def test_mla_decode_falls_back_before_touching_the_cache():
    layer = _mla(torch.float32)
    x = torch.randn(1, layer.q_a_proj.weight.shape[1])
    cache = _mla_cache(layer, [3], torch.float32, 0)
    batch = ForwardBatch.from_lengths(torch.zeros(1, dtype=torch.long), [1], cache=_Cache(1))
    with torch.no_grad():
        assert layer._decode_fused(x.bfloat16(), batch, cache) is None  # dtype mismatch
        assert cache.latents[0].shape[0] == 3  # nothing appended
        with dispatch.use_impl("mla_decode", "ref"):
            assert layer._decode_fused(x, batch, cache) is None
        assert layer._decode_fused(x, batch, cache) is not None and cache.latents[0].shape[0] == 4


# ---- kernels prepared once per module (cpu_kernels.packs) ----------------------------------------------------------


def _prepared(module):
    pack = packs._packs.get(module)
    return None if pack is None else pack.value


def test_a_prepared_kernel_is_reused_and_reads_weights_changed_in_place():
    moe = _moe(torch.float32, True)
    x = torch.randn(1, moe.gate.weight.shape[1])
    with torch.no_grad():
        moe(x)
        kernel = _prepared(moe)
        assert kernel is not None
        moe.routed_expert_up_proj.weight.mul_(-2.0)  # an optimizer step or a weight sync: values change in place
        out = moe(x)
        assert _prepared(moe) is kernel
        with torch_path():
            ref = moe(x)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("change", ["replace", "hookless", "data", "cast", "submodule"])
def test_a_prepared_kernel_is_rebuilt_when_its_weights_move(change):
    moe = _moe(torch.float32, True)
    x = torch.randn(1, moe.gate.weight.shape[1])
    with torch.no_grad():
        moe(x)
        kernel = _prepared(moe)
        up = moe.routed_expert_up_proj
        if change == "replace":  # load_state_dict(assign=True), expert parallelism: a new Parameter object
            up.weight = torch.nn.Parameter(torch.randn_like(up.weight), requires_grad=False)
        elif change == "hookless":  # as FSDP2 swaps its parameters: no registration hook fires
            up._parameters["weight"] = torch.nn.Parameter(torch.randn_like(up.weight), requires_grad=False)
        elif change == "data":  # the same Parameter on new storage
            up.weight.data = torch.randn_like(up.weight)
        elif change == "cast":  # .to(): a dtype the kernel must now see as bf16
            moe.to(torch.bfloat16)
            moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
            x = x.bfloat16()
        else:  # a swapped submodule
            moe.routed_expert_norm = RMSNorm(moe.routed_expert_norm.weight.shape[0], 1e-6).requires_grad_(False)
            moe.routed_expert_norm.weight.fill_(0.5)
        out = moe(x)
        assert _prepared(moe) is not kernel and _prepared(moe) is not None
        with torch_path():
            ref = moe(x)
    _close(out, ref, x.dtype)


def test_mix_norm_prepares_per_site_and_modules_still_copy():
    import copy
    import pickle

    D = 16
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(D, 1e-6).requires_grad_(False)
    proj_a, proj_b = (torch.nn.Linear(D, 1, bias=False).requires_grad_(False) for _ in range(2))
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=g))  # RMSNorm's weight starts as torch.empty: set it
        proj_a.weight.copy_(torch.randn(1, D, generator=g) / D**0.5)
        proj_b.weight.copy_(-3.0 * proj_a.weight + 0.1 * torch.randn(1, D, generator=g))
        bank, partial = [torch.randn(2, D, generator=g)], torch.randn(2, D, generator=g)
        for proj in (proj_a, proj_b, proj_a):  # the same key norm with another query: not the other's kernel
            _close(mix_norm(bank, partial, norm, proj, norm), norm(mix(bank, partial, norm, proj)), torch.float32)
    assert _prepared(norm) is not None
    pickle.loads(pickle.dumps(norm))  # the pack lives beside the module, not on it
    copied = copy.deepcopy(norm)
    with torch.no_grad():
        _close(mix_norm(bank, partial, copied, proj_a, copied), norm(mix(bank, partial, norm, proj_a)), torch.float32)
