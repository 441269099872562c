"""K3ForCausalLM: parameter counts, cached decode and padding equivalences, initialisation, dtypes, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from openk3 import K3Config, K3ForCausalLM
from openk3.model.model import keeps_fp32
from openk3.utils import rel_rms


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    return model.eval()


def test_k3_preset_on_meta_matches_released_counts():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.preset("k3"))
    total, active = model.num_parameters()
    print(f"k3 preset: total {total:,} parameters, active {active:,}")
    assert total == 2_779_484_476_000  # spec/model.md §13, text model
    assert active == 104_189_612_640
    assert abs(total / 2.78e12 - 1) < 5e-3 and abs(active / 104.2e9 - 1) < 5e-3
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("name, low, high", [("tiny", 1e6, 10e6), ("small", 100e6, 300e6)])
def test_preset_sizes(name, low, high):
    with torch.device("meta"):
        total, active = K3ForCausalLM(K3Config.preset(name)).num_parameters()
    print(f"{name}: total {total:,}, active {active:,}")
    assert low <= total <= high and active < total


def test_cached_decode_matches_full_forward(tiny):
    ids = torch.randint(0, 1000, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = tiny(ids).logits
        cache = tiny.new_cache(2)
        steps = [tiny(ids[:, :6], None, cache).logits]
        steps += [tiny(ids[:, t : t + 1], None, cache).logits for t in range(6, 41)]
    err = rel_rms(torch.cat(steps, 1), full)
    print(f"cached decode vs full forward: {err:.2e}")
    assert err <= 1e-5
    assert cache.seen_tokens == [41, 41]


@pytest.mark.parametrize("cuts", [[1], [16], [17, 33], [5, 6, 7, 40]])
def test_chunked_prefill_matches_whole(tiny, cuts):
    ids = torch.randint(0, 1000, (1, 45), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = tiny(ids).logits
        cache = tiny.new_cache(1)
        bounds = [0, *cuts, 45]
        parts = [tiny(ids[:, a:b], None, cache).logits for a, b in zip(bounds[:-1], bounds[1:])]
    assert rel_rms(torch.cat(parts, 1), whole) <= 1e-5


def test_padded_batch_matches_each_sequence_alone(tiny):
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1000, (n,), generator=gen) for n in (3, 20, 37, 1)]
    T = max(len(s) for s in seqs)
    pad = tiny.text_config.pad_token_id
    ids = torch.full((len(seqs), T), pad)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding, the released convention
        ids[i, T - len(s) :] = s
        mask[i, T - len(s) :] = 1
    with torch.no_grad():
        batched = tiny(ids, mask).logits
        for i, s in enumerate(seqs):
            alone = tiny(s[None]).logits[0]
            assert rel_rms(batched[i, T - len(s) :], alone) <= 1e-5
            assert torch.all(batched[i, : T - len(s)] == 0)
        # Padding on the right works the same way: only the mask decides what is a token.
        right_ids, right_mask = torch.full_like(ids, pad), torch.zeros_like(mask)
        for i, s in enumerate(seqs):
            right_ids[i, : len(s)], right_mask[i, : len(s)] = s, 1
        right = tiny(right_ids, right_mask).logits
        for i, s in enumerate(seqs):
            assert rel_rms(right[i, : len(s)], batched[i, T - len(s) :]) <= 1e-5


def test_padded_batch_decode_matches_alone(tiny):
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 1000, (5,), generator=gen), torch.randint(0, 1000, (12,), generator=gen)
    ids = torch.full((2, 12), tiny.text_config.pad_token_id)
    mask = torch.zeros(2, 12, dtype=torch.long)
    ids[0, 7:], mask[0, 7:] = a, 1
    ids[1], mask[1] = b, 1
    nxt = torch.randint(0, 1000, (2, 4), generator=gen)
    with torch.no_grad():
        cache = tiny.new_cache(2)
        tiny(ids, mask, cache)
        steps = torch.cat([tiny(nxt[:, t : t + 1], None, cache).logits for t in range(4)], 1)
        for i, s in enumerate((a, b)):
            alone = tiny(torch.cat([s, nxt[i]])[None]).logits[0, -4:]
            assert rel_rms(steps[i], alone) <= 1e-5


def _greedy_without_cache(model, ids, n):
    out, margins = ids, []
    for _ in range(n):
        logits = model(out).logits[:, -1]
        top2 = logits.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).min().item())
        out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
    return out, margins


def test_generate_greedy_matches_recompute(tiny):
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        fast = tiny.generate(ids, max_new_tokens=12)
        slow, margins = _greedy_without_cache(tiny, ids, 12)
    # Compare up to the first near-tie (STYLE.md §5: margins above 1e-4).
    upto = next((i for i, m in enumerate(margins) if m <= 1e-4), len(margins))
    assert upto >= 8
    assert torch.equal(fast[:, : 7 + upto], slow[:, : 7 + upto])


def test_generate_sampling_is_seeded_and_stops_at_eos(tiny):
    ids = torch.randint(0, 1000, (3, 4), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        a = tiny.generate(ids, max_new_tokens=6, temperature=1.0, top_p=0.9, seed=11)
        b = tiny.generate(ids, max_new_tokens=6, temperature=1.0, top_p=0.9, seed=11)
        assert torch.equal(a, b) and a.shape == (3, 10)
        first = a[0, 4].item()
        stopped = tiny.generate(ids[:1], max_new_tokens=6, temperature=1.0, top_p=0.9, seed=11, eos_token_id=first)
    assert stopped.shape == (1, 5)
    with pytest.raises(ValueError, match="left padding"):
        tiny.generate(ids, attention_mask=torch.tensor([[1, 1, 1, 0]] * 3))


def test_init_weights_follows_the_recipe():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.preset("tiny"))
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    text = model.text_config
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.isfinite(p).all(), name
        if name.endswith("_res_proj.weight"):
            assert torch.all(p == 0), name  # AttnRes starts as the plain mean of its sources
        elif name.endswith(("A_log", "e_score_correction_bias")):
            assert torch.all(p == 0), name
        elif name.endswith(("norm.weight", "layernorm.weight")):
            assert torch.all(p == 1), name
    dt = torch.nn.functional.softplus(params["model.layers.0.self_attn.dt_bias"])
    assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6
    assert torch.all(model.model.embed_tokens.weight[text.pad_token_id] == 0)
    std = params["model.layers.0.self_attn.q_proj.weight"].std().item()
    assert math.isclose(std, text.initializer_range, rel_tol=0.05)
    with torch.no_grad():
        logits = model(torch.randint(0, 1000, (1, 20))).logits
    assert torch.isfinite(logits).all()


def test_random_init_leaves_no_zero_or_constant_tensor(tiny):
    for name, p in tiny.named_parameters():
        assert not torch.all(p == 0), name
        assert p.numel() == 1 or p.std() > 0, name


def test_every_parameter_gets_a_gradient(tiny):
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(1)
    ids = torch.randint(0, 1000, (2, 19), generator=torch.Generator().manual_seed(7))
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    for name, p in model.named_parameters():
        if name.endswith("e_score_correction_bias"):
            assert p.grad is None and not p.requires_grad  # moved by balancing, never by gradients
            continue
        if name.startswith("model.layers.0.self_attention_res_"):
            assert p.grad is None  # layer 0's attention site never mixes (empty bank); kept so checkpoints load
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if "experts.w" not in name:  # an expert may receive no token in a short batch
            assert p.grad.abs().sum() > 0, name


def test_to_dtype_keeps_release_fp32_tensors(tiny):
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    model.to_dtype(torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if keeps_fp32(name) else torch.bfloat16), name
    outputs = {}
    for tag, m in (("bf16", model), ("fp32", tiny)):
        m.model.layers[0].register_forward_hook(lambda mod, args, out, tag=tag: outputs.__setitem__(tag, out))
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        out = model(ids).logits
        tiny(ids)
    for m in (model, tiny):
        m.model.layers[0]._forward_hooks.clear()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    # One layer in bf16 stays at the bf16 rounding level (the whole random model is compared in
    # test_checkpoint.py; deeper, random routers flip near-tie expert choices in bf16).
    assert rel_rms(outputs["bf16"].float(), outputs["fp32"]) < 2e-2


def test_cache_holds_latent_not_expanded_heads(tiny):
    text = tiny.text_config
    cache = tiny.new_cache(1)
    before = cache.nbytes()
    with torch.no_grad():
        tiny(torch.randint(0, 1000, (1, 10)), None, cache)
    mla_layers = sum(text.layer_kind(i) == "mla" for i in range(text.num_hidden_layers))
    per_token = mla_layers * (text.kv_lora_rank + text.qk_rope_head_dim) * 4
    assert cache.nbytes() - before == 10 * per_token  # KDA state is fixed-size; only the MLA latent grows


def test_absorbed_weights_follow_the_weight_version(tiny):
    """Decode's fp32 W_uk/W_uv are computed once per kv_b_proj weight version: reused across steps, recomputed
    after an in-place update (an optimizer step, a weight sync), a reload or a dtype change."""
    import copy

    from openk3.model.batch import ForwardBatch
    from openk3.model.cache import MLACache

    torch.manual_seed(3)
    layer = copy.deepcopy(next(layer.self_attn for layer in tiny.model.layers if layer.kind == "mla"))
    R = layer.kv_rank + layer.rope
    x_TD = torch.randn(2, tiny.text_config.hidden_size)

    def decode():
        cache = MLACache([torch.randn(n, R, generator=torch.Generator().manual_seed(n)) for n in (3, 9)])
        with torch.no_grad():
            return layer(x_TD, ForwardBatch.from_lengths(torch.zeros(2, dtype=torch.long), [1, 1], cache), cache)

    def expanded():  # the same step without the absorbed form: keys and values expanded from every latent
        cache = MLACache([torch.randn(n, R, generator=torch.Generator().manual_seed(n)) for n in (3, 9)])
        with torch.no_grad():
            return layer(x_TD, ForwardBatch.from_lengths(torch.zeros(2, dtype=torch.long), [1, 1], cache,
                                                         mode="extend"), cache)  # fmt: skip

    first = decode()
    w_uk = layer.absorbed()[0]
    assert rel_rms(first, expanded()) <= 1e-5
    assert layer.absorbed()[0] is w_uk and torch.equal(decode(), first)  # cached, not recomputed
    saved = {k: v.clone() for k, v in layer.state_dict().items()}
    with torch.no_grad():
        layer.kv_b_proj.weight.mul_(1.5)
    assert layer.absorbed()[0] is not w_uk and torch.equal(layer.absorbed()[0], 1.5 * w_uk)
    changed = decode()
    assert rel_rms(changed, first) > 1e-2 and rel_rms(changed, expanded()) <= 1e-5
    layer.load_state_dict(saved)
    assert torch.equal(layer.absorbed()[0], w_uk) and torch.equal(decode(), first)
    reloaded = layer.absorbed()[0]
    layer.to(torch.float64)
    assert layer.absorbed()[0] is not reloaded and layer.absorbed()[0].dtype == torch.float32
    assert torch.equal(layer.absorbed()[0], w_uk)


def test_observer_sees_router_scores(tiny):
    seen = []
    moe = tiny.model.layers[1].block_sparse_moe
    moe.observer = lambda module, scores, idx: seen.append((scores.shape, idx.shape))
    try:
        with torch.no_grad():
            tiny(torch.randint(0, 1000, (1, 5)))
    finally:
        moe.observer = None
    text = tiny.text_config
    assert seen == [((5, text.num_experts), (5, text.num_experts_per_token))]


def test_bad_inputs(tiny):
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask shape"):
        tiny(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 4))
    with pytest.raises(ValueError, match="no tokens"):
        tiny(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [0, 0, 0]]))
    cache = tiny.new_cache(2)
    with pytest.raises(ValueError, match="2 sequences"):
        tiny(torch.zeros(3, 1, dtype=torch.long), None, cache)


def test_packed_documents_match_each_document_alone(tiny):
    """Training rows hold several documents: KDA restarts its state and conv, MLA attends only within a document."""
    from openk3.model.batch import ForwardBatch

    ids = torch.randint(0, 768, (3, 40), generator=torch.Generator().manual_seed(8))
    docs = [[10, 25, 5], [40], [1, 16, 17, 6]]
    with torch.no_grad():
        packed = tiny.forward_batch(ForwardBatch.from_rows(ids, docs)).view(3, 40, -1)
        for r, lens in enumerate(docs):
            start = 0
            for n in lens:
                alone = tiny(ids[r : r + 1, start : start + n]).logits[0]
                assert rel_rms(packed[r, start : start + n], alone) <= 1e-5
                start += n
    with pytest.raises(ValueError, match="sum to the row length"):
        ForwardBatch.from_rows(ids, [[10, 20], [40], [40]])


@pytest.mark.parametrize("T", [1, 3, 7])
def test_gathered_and_grouped_expert_dispatch_agree(tiny, T):
    from openk3.model.moe import gathered_dispatch, grouped_dispatch

    moe = next(layer.block_sparse_moe for layer in tiny.model.layers if hasattr(layer, "block_sparse_moe"))
    gen = torch.Generator().manual_seed(T)
    z = torch.randn(T, moe.experts.w1.shape[-1], generator=gen)
    idx = torch.stack([torch.randperm(moe.experts.w1.shape[0], generator=gen)[:2].sort().values for _ in range(T)])
    w = torch.rand(T, 2, generator=gen)
    with torch.no_grad():
        assert rel_rms(gathered_dispatch(z, idx, w, moe.experts), grouped_dispatch(z, idx, w, moe.experts)) <= 1e-6


def test_kda_runs_the_branch_its_mode_names(tiny, monkeypatch):
    """KimiDeltaAttention branches on `batch.mode`, not on the lengths: one token per sequence asked as EXTEND runs
    the packed conv and the chunked op (equal to DECODE's step to rounding), VERIFY with G = 1 runs the verify op
    and writes nothing, DECODE runs the step. Modes are inferred only as full / decode / extend and checked."""
    import openk3.model.kda as kda_module
    from openk3.model.batch import ForwardBatch, Mode
    from openk3.model.cache import K3Cache
    from openk3.ops import cpu_kernels
    from openk3.ops.dispatch import use_impl

    layer = tiny.model.layers[0].self_attn
    calls: list[str] = []
    for name in ("kda_step", "kda_chunked", "kda_verify", "short_conv", "short_conv_varlen", "short_conv_few"):

        def spy(*args, _fn=getattr(kda_module, name), _name=name, **kwargs):  # noqa: B008 - bound per name
            calls.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(kda_module, name, spy)
    gen = torch.Generator().manual_seed(9)
    N, D = 3, tiny.text_config.hidden_size
    x_ND = torch.randn(N, D, generator=gen)
    start = K3Cache(tiny.config, N, torch.float32)
    for t in vars(start.layers[0]).values():
        t.normal_(generator=gen)

    def run(mode):
        cache = K3Cache(tiny.config, N, torch.float32)
        cache.layers[0] = type(start.layers[0])(*(t.clone() for t in vars(start.layers[0]).values()))
        cache.layers[0].record = lambda steps, pre: calls.append("record")
        calls.clear()
        batch = ForwardBatch.from_lengths(torch.zeros(N, dtype=torch.long), [1] * N, cache, mode=mode)
        with torch.no_grad():
            out = layer(x_ND, batch, cache.layers[0])
        return out, cache.layers[0], list(calls)

    # On CPU, DECODE runs the fused kernel (ops.cpu_kernels) where it is built, on any ISA: a compiler exists and
    # the build fails only on a compile error (tests/ops/test_cpu_kernel_builds.py); else the torch step.
    fused, fused_state, fused_calls = run(None)
    if cpu_kernels.compiler() is not None:
        assert cpu_kernels.available(), cpu_kernels.failure()
        assert not {"kda_step", "short_conv_few", "kda_chunked"} & set(fused_calls)
    else:
        assert fused_calls.count("kda_step") == 1
    with use_impl("kda_decode", "ref"):  # ... whose reference is the torch step
        decode, dec_state, dec_calls = run(None)
    assert dec_calls.count("kda_step") == 1 and dec_calls.count("short_conv_few") == 3
    assert rel_rms(fused, decode) <= 1e-5
    assert "kda_chunked" not in dec_calls and "short_conv_varlen" not in dec_calls
    extend, ext_state, ext_calls = run(Mode.EXTEND)
    assert ext_calls.count("kda_chunked") == 1 and ext_calls.count("short_conv_varlen") == 3
    assert "kda_step" not in ext_calls and "short_conv_few" not in ext_calls
    assert rel_rms(extend, decode) <= 1e-5

    def tensors(entry):
        tails, state = entry.load()
        return [*tails, state]

    for a, b, c in zip(tensors(ext_state), tensors(dec_state), tensors(fused_state), strict=True):
        assert rel_rms(a, b) <= 1e-5 and rel_rms(c, b) <= 1e-5
    verify, ver_state, ver_calls = run("verify")
    assert ver_calls.count("kda_verify") == 1 and ver_calls.count("record") == 1 and "kda_step" not in ver_calls
    assert rel_rms(verify, decode) <= 1e-5
    for a, b in zip(tensors(ver_state), tensors(start.layers[0]), strict=True):
        assert torch.equal(a, b)  # verify writes no state
    # Inference and checks at the builder.
    ids = torch.zeros(4, dtype=torch.long)
    assert ForwardBatch.from_lengths(ids, [2, 2]).mode is Mode.FULL
    assert ForwardBatch.from_lengths(ids, [1, 1, 1, 1], start).mode is Mode.DECODE
    assert ForwardBatch.from_lengths(ids, [3, 1], start).mode is Mode.EXTEND
    with pytest.raises(ValueError, match="decode"):
        ForwardBatch.from_lengths(ids, [3, 1], start, mode=Mode.DECODE)
    with pytest.raises(ValueError, match="verify"):
        ForwardBatch.from_lengths(ids, [3, 1], start, mode=Mode.VERIFY)
    with pytest.raises(ValueError, match="needs a cache"):
        ForwardBatch.from_lengths(ids, [2, 2], mode=Mode.EXTEND)
