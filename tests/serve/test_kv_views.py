"""The MLA page view (serve/kv/views.py) against the contiguous reference cache (model/cache.py): batched writes
through ragged, non-consecutive block tables, the batched block-table read that the absorbed decode runs on, and
that NaN-poisoned (unwritten) pool memory is never read."""

from __future__ import annotations

import pytest
import torch

from openk3.config import K3Config
from openk3.model.cache import MLACache
from openk3.ops.attention.mla import absorbed_weights, mla_decode, mla_decode_ref
from openk3.serve.kv.block_pool import HybridPools
from openk3.serve.kv.views import MLAPageView, PageTables
from openk3.utils import rel_rms

B = 4  # tokens per page


def _poisoned_pools(dtype, num_slots=2):
    text = K3Config.preset("tiny").text_config
    pools = HybridPools(text, num_blocks=32, block_size=B, num_slots=num_slots, dtype=dtype, device="cpu")
    pools.latent_MNBR.fill_(float("nan"))
    return text, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_view_matches_contiguous_cache_and_never_reads_poison(dtype):
    text, pools = _poisoned_pools(dtype)
    R = text.kv_lora_rank + text.qk_rope_head_dim
    # One token on one page; many non-consecutive pages; a consecutive run; a run that starts mid-pool.
    tables = [[5], [9, 2, 17, 3, 11], [20, 21, 22], [0, 1]]
    past = [0, 13, 7, 5]
    gen = torch.Generator().manual_seed(0)
    pages = PageTables(tables, B, "cpu")
    assert pages.runs == [20, None, 80, 0]
    ref = MLACache([torch.zeros(0, R, dtype=dtype) for _ in tables])
    # A ragged extend (one sequence writes nothing), then a decode step of one token each.
    prefill = MLAPageView(pools, 1, pages, [0] * 4)
    x = torch.randn(sum(past), R, generator=gen).to(dtype)
    prefill.append(x, past)
    ref.append(x, past)
    for i in range(4):
        assert torch.equal(prefill.past(i), ref.past(i))
    decode = MLAPageView(pools, 1, PageTables(tables, B, "cpu"), past)
    x = torch.randn(4, R, generator=gen).to(dtype)
    decode.append(x, [1] * 4)
    ref.append(x, [1] * 4)
    block_NSR, len_N = decode.block()
    assert len_N.tolist() == [1, 14, 8, 6] and block_NSR.shape == (4, 14, R)
    assert torch.isfinite(block_NSR).all()  # padding repeats a written position, never the poisoned memory
    for i in range(4):
        assert torch.equal(block_NSR[i, : len_N[i]], ref.past(i)) and torch.equal(decode.past(i), ref.past(i))
        assert torch.equal(block_NSR[i, len_N[i] :], ref.past(i)[-1:].expand(14 - len_N[i], R))
    # Exactly the written positions of layer 1 are finite; the other MLA layers' pages were never touched.
    assert int(torch.isfinite(pools.latent_MNBR[1]).all(-1).sum()) == 29
    assert not torch.isfinite(pools.latent_MNBR[0]).any()
    # The batched absorbed decode on the paged block equals the per-sequence reference on the contiguous cache.
    H, nope = text.num_attention_heads, text.qk_nope_head_dim
    q = torch.randn(4, H, nope + text.qk_rope_head_dim, generator=gen).to(dtype)
    w = torch.randn(H * (nope + text.v_head_dim), text.kv_lora_rank, generator=gen).to(dtype) * 0.1
    out = mla_decode(q, block_NSR, len_N, *absorbed_weights(w, H, nope), 0.1)
    expected = mla_decode_ref(q, ref.latents, w, nope, 0.1)
    assert torch.isfinite(out).all()
    assert rel_rms(out.float(), expected.float()) <= (1e-6 if dtype == torch.float32 else 1e-2)


def test_single_run_block_is_a_view_of_the_pool():
    text, pools = _poisoned_pools(torch.float32)
    view = MLAPageView(pools, 0, PageTables([[6, 7, 8]], B, "cpu"), [0])
    view.append(torch.randn(10, text.kv_lora_rank + text.qk_rope_head_dim), [10])
    block, len_N = view.block()
    assert block.shape[:2] == (1, 10) and len_N.tolist() == [10]
    assert block.data_ptr() == pools.latent_MNBR[0, 6].data_ptr()  # no copy
    assert torch.isfinite(block).all()


def test_writes_past_the_allocated_pages_are_refused():
    _, pools = _poisoned_pools(torch.float32)
    view = MLAPageView(pools, 0, PageTables([[3]], B, "cpu"), [3])
    with pytest.raises(AssertionError, match="past the pages"):
        view.append(torch.zeros(2, pools.latent_MNBR.shape[-1]), [2])


def test_paged_decode_matches_full_forward():
    """The model on poisoned, ragged, non-consecutive pages: a chunked prefill (extend), then batched absorbed
    decode steps, give each sequence's logits of a full forward of that sequence alone."""
    from openk3.model.batch import ForwardBatch
    from openk3.model.model import K3ForCausalLM
    from openk3.serve.kv.views import PagedCache

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    model.eval()
    _, pools = _poisoned_pools(torch.float32, num_slots=4)  # KDA states start at zero in slots 1..3
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=gen) for n in (1, 23, 9)]
    steps = torch.randint(0, 1000, (3, 3), generator=gen)
    tables = [[30], [12, 3, 27, 8, 19, 1, 22], [6, 7, 15, 16]]  # room for prompt + 3 decodes, scattered
    lens, out = [len(p) for p in prompts], [[] for _ in prompts]
    with torch.no_grad():
        cache = PagedCache(pools, [1, 2, 3], tables, [0, 0, 0], lens)
        batch = ForwardBatch.from_lengths(torch.cat(prompts), lens, cache)
        assert batch.mode == "extend"
        logits = model.forward_batch(batch)
        for i, end in enumerate(torch.tensor(lens).cumsum(0).tolist()):
            out[i].append(logits[end - 1])
        for t in range(3):
            cache = PagedCache(pools, [1, 2, 3], tables, [n + t for n in lens], [1, 1, 1])
            batch = ForwardBatch.from_lengths(steps[:, t], [1, 1, 1], cache)
            assert batch.mode == "decode"
            for i, row in enumerate(model.forward_batch(batch)):
                out[i].append(row)
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, steps[i, :3]])[None]).logits[0, len(p) - 1 :]
            assert rel_rms(torch.stack(out[i]), alone) <= 1e-5
