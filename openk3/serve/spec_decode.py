"""Speculative decoding with input replay: proposers, acceptance, and the fold.

Proposers return draft tokens for a decoding request: `NgramProposer` (prompt lookup: the tokens that followed the
latest earlier occurrence of the context's last n-gram; no extra model) and `DraftModelProposer` (a small K3 that
shares the target's vocabulary, run greedily on its own contiguous cache).

The target verifies 1 + k tokens per request in one forward in mode VERIFY: KDA layers run the decode
step on register copies and record each step's inputs, writing no state. `accept` applies the rejection rule
(greedy: drafts must equal the target's argmax; sampling: a draft d is kept with probability p(d), else the token
is drawn from p with d removed; both keep the target's distribution exactly, since drafts are point masses).
`fold` then replays the recorded inputs of the accepted prefix onto each working slot with `kda_fold`, the
verify pass's own function on the same batch shape, so the folded state is bitwise the state verify held.

Legend: N requests, G = 1 + drafts, H heads, K/V head dims, W conv width, P projected width, V vocabulary.
"""

from __future__ import annotations

import copy

import torch

from openk3.ops.conv import roll_tail
from openk3.ops.dispatch import kda_fold
from openk3.ops.sampling import draw
from openk3.serve.kv.block_pool import HybridPools
from openk3.serve.kv.views import KDARecord
from openk3.serve.request import Request


class NgramProposer:
    """Prompt lookup decoding: match the last n tokens (n from `max_n` down to `min_n`) earlier in the context and
    propose the k tokens that followed its latest occurrence. Each request keeps an index from every n-gram to its
    latest end position, extended by the new tokens at each call, so a lookup costs O(new tokens), not O(context)."""

    def __init__(self, max_n: int = 4, min_n: int = 3):
        self.max_n, self.min_n = max_n, min_n
        self.index: dict[int, tuple[int, dict[tuple[int, ...], int]]] = {}  # id(req) -> (indexed upto, n-gram -> end)

    def __call__(self, req: Request, k: int) -> list[int]:
        tokens = req.tokens
        L = len(tokens)
        done, table = self.index.get(id(req), (0, {}))
        # Index every n-gram that ends before the last token (it must have a successor to propose).
        for end in range(max(done, self.min_n), L):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                table[tuple(tokens[end - n : end])] = end
        self.index[id(req)] = (L, table)
        for n in range(self.max_n, self.min_n - 1, -1):
            if L < n + 1:
                continue
            start = table.get(tuple(tokens[L - n :]))
            if start is not None and start < L:
                # Copy forward from there; a match close to the end overlaps its own copy (LZ77-style), so a
                # repeating run keeps proposing full windows instead of stopping at the end of the context.
                drafts: list[int] = []
                for i in range(k):
                    drafts.append(tokens[start + i] if start + i < L else drafts[start + i - L])
                return drafts
        return []

    def release(self, req: Request) -> None:
        self.index.pop(id(req), None)


class DraftModelProposer:
    """A small K3 drafting greedily. Per request it keeps a cache at the last committed position; a proposal feeds
    the tokens accepted since, then drafts on a copy, so rejected drafts never touch the committed cache."""

    def __init__(self, draft_model, target_vocab: int):
        if draft_model.text_config.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model's vocab_size {draft_model.text_config.vocab_size} differs from the target's "
                f"{target_vocab}; a draft model must share the target's tokenizer"
            )
        self.model = draft_model
        self.device = next(draft_model.parameters()).device
        self.caches: dict[int, tuple[object, int, torch.Tensor | None]] = {}  # id(req) -> (cache, fed, last logits)

    @torch.inference_mode()
    def __call__(self, req: Request, k: int) -> list[int]:
        tokens = req.tokens
        cache, fed, _ = self.caches.get(id(req), (None, 0, None))
        if cache is None or fed > len(tokens) - 1:
            cache, fed = self.model.new_cache(1), 0
        if fed < len(tokens) - 1:  # commit everything but the last token (the verify pass's first input)
            ids = torch.tensor([tokens[fed : len(tokens) - 1]], device=self.device)
            self.model(ids, None, cache, return_dict=False)
            fed = len(tokens) - 1
        self.caches[id(req)] = (cache, fed, None)
        draft_cache = copy.deepcopy(cache)
        nxt, drafts = tokens[-1], []
        for _ in range(k):
            logits = self.model(torch.tensor([[nxt]], device=self.device), None, draft_cache, return_dict=False)[0, -1]
            nxt = int(logits.argmax())
            drafts.append(nxt)
        return drafts

    def release(self, req: Request) -> None:
        self.caches.pop(id(req), None)


class AdaptiveProposer:
    """Wraps a proposer and sizes each request's draft window by how its drafts fared: it starts at 2, all accepted
    doubles it (up to k), a partial acceptance of a sets it to a + 1, and none accepted sets it to 1 and makes the
    request decode plainly for 2^failures steps (at most `max_skip`) before drafting again. A failed verify then
    costs one extra token, rarely; on text the proposer predicts, the window stays full."""

    def __init__(self, proposer, max_skip: int = 32):
        self.proposer, self.max_skip = proposer, max_skip
        self.state: dict[int, list[int]] = {}  # id(req) -> [window, failures, steps left to skip]

    def __call__(self, req: Request, k: int) -> list[int]:
        window, _, skip = self.state.setdefault(id(req), [2, 0, 0])  # start small; success doubles it
        if skip > 0:
            self.state[id(req)][2] -= 1
            return []
        return self.proposer(req, min(k, window))

    def update(self, req: Request, drafted: int, accepted: int) -> None:
        st = self.state.setdefault(id(req), [2, 0, 0])
        if accepted == drafted:
            st[:] = [2 * drafted, 0, 0]
        elif accepted:
            st[:] = [accepted + 1, 0, 0]
        else:
            st[0], st[1] = 1, st[1] + 1
            st[2] = min(2 ** st[1], self.max_skip)

    def release(self, req: Request) -> None:
        self.state.pop(id(req), None)
        self.proposer.release(req)


def accept(
    logits_GV: torch.Tensor, probs_GV: torch.Tensor | None, drafts: list[int], generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """Tokens emitted for one verified request and the rows of `logits_GV` they were sampled from.

    Row j holds the target's distribution after the last accepted token and drafts[:j]. `probs_GV` are the rows'
    sampling distributions (`ops.sampling.sampling_probs_rows`), None for a greedy request; the random draws come
    from the request's `generator`."""
    out, rows = [], []
    for j, d in enumerate(drafts):
        if probs_GV is None:
            target = int(logits_GV[j].argmax())
            out.append(target)
            rows.append(j)
            if target != d:
                return out, rows
            continue
        p = probs_GV[j]
        if torch.rand((), generator=generator) < p[d]:
            out.append(d)
            rows.append(j)
            continue
        residual = p.clone()
        residual[d] = 0
        if residual.sum() <= 0:  # p was a point mass on d, which rand() < 1 always accepts; kept for safety
            residual = p
        out.append(int(draw((residual / residual.sum())[None], [generator])))
        rows.append(j)
        return out, rows
    G = len(drafts)
    bonus = int(logits_GV[G].argmax()) if probs_GV is None else int(draw(probs_GV[G : G + 1], [generator]))
    return out + [bonus], rows + [G]


@torch.inference_mode()
def fold(pools: HybridPools, slots: list[int], records: list[KDARecord], consumed: list[int]) -> None:
    """Replay the first `consumed[n]` recorded steps of request n onto its working slot, for every KDA layer:
    the state by `kda_fold` (the verify pass's decode step on the whole batch; rows past their count keep their
    state), the conv tails by rolling in the recorded pre-conv rows (`roll_tail`)."""
    device = pools.state_NkSHKV.device
    slots_N = torch.tensor(slots, dtype=torch.long, device=device)
    used_N = torch.tensor(consumed, dtype=torch.long, device=device)
    for j, record in enumerate(records):
        state = pools.state_NkSHKV[j].index_select(0, slots_N)
        pools.state_NkSHKV[j].index_copy_(0, slots_N, kda_fold(record.steps, state, used_N))
        conv = pools.conv_Nk3SWP[j]
        for c in range(3):
            conv[c].index_copy_(0, slots_N, roll_tail(conv[c].index_select(0, slots_N), record.pre_conv_NGP[c], used_N))
