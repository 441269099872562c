"""Context parallelism on gloo: each rank holds a contiguous shard of every row (lengths not divisible by the
degree) with packed documents cut at shard edges: one spanning three ranks, one starting exactly at a shard
boundary, ranks holding several. The loss and every parameter gradient equal the single-process run (fp32, relative
RMS <= 2e-5 over all gradients, <= 1e-4 per tensor) for cp = 2 and cp = 4, and the bytes a rank sends per KDA layer
do not grow with the sequence length."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_ranks
from grad_match import assert_gradients_match
from test_ep import two_layer_model

from openk3.model.batch import ForwardBatch

# Row length 23: cp=2 shards [12, 11], cp=4 shards [6, 6, 6, 5]. Row 0's middle document spans positions 3..17
# (three ranks at cp=4); row 1's second document starts at 12 (the cp=2 boundary), row 2's at 6 (a cp=4 boundary).
DOCS = {23: [[3, 15, 5], [12, 11], [6, 17], [23]]}


def ids(length: int) -> torch.Tensor:
    return torch.randint(0, 700, (len(docs(length)), length + 1), generator=torch.Generator().manual_seed(length))


def docs(length: int) -> list[list[int]]:
    return DOCS.get(length, [[length], [length // 2, length - length // 2]])


def cp_rank(rank: int, world: int, length: int):
    from openk3.parallel.cp import CommCounter, ContextParallel, apply_context_parallel

    model = two_layer_model()
    counter = CommCounter()
    cp = ContextParallel(dist.group.WORLD, counter)
    assert apply_context_parallel(model, cp) == 4
    x, y = ids(length)[:, :-1], ids(length)[:, 1:]
    batch = cp.shard(x, docs(length))
    start, n = batch.context_parallel.start, batch.context_parallel.lengths[rank]
    logits = model.forward_batch(batch)
    loss = F.cross_entropy(logits, y[:, start : start + n].reshape(-1), reduction="sum") / y.numel()
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # every rank holds the same parameters: sum their shards' contributions
            grads[name] = p.grad.clone()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total), grads, dict(counter.bytes)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_single_process(world):
    length = 23
    model = two_layer_model()
    x, y = ids(length)[:, :-1], ids(length)[:, 1:]
    logits = model.forward_batch(ForwardBatch.from_rows(x, docs(length)))
    ref = F.cross_entropy(logits, y.reshape(-1))
    ref.backward()
    for loss, grads, _ in run_ranks(world, cp_rank, length):
        assert abs(loss - float(ref)) <= 1e-5 * float(ref)
        assert_gradients_match(grads, {name: p.grad for name, p in model.named_parameters() if p.grad is not None})


def test_kda_communication_does_not_grow_with_length():
    short = run_ranks(2, cp_rank, 12)[0][2]
    long = run_ranks(2, cp_rank, 48)[0][2]
    for kind in ("kda_summary", "conv_halo", "kda_summary_backward", "conv_halo_backward"):
        assert short[kind] == long[kind] > 0, kind
    assert long["mla_latent"] > short["mla_latent"]  # MLA's latents do grow: that is the other layer kind
    print(f"bytes one rank contributes per step (3 KDA layers and 1 MLA layer): length 12 {short}, length 48 {long}")
