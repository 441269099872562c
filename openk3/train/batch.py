"""`TokenBatch`: what one forward of the training core (train/core.py) trains on, whatever the kind of training:
packed sequences (this rank's share), the token each position predicts, the loss mask, and named per-token fields
that the losses (train/losses.py) read.

Position t of a sequence of n tokens is fed token t and scores token t + 1 (t = 0..n-2: the last token is never fed,
as in the rollout engine, so routes recorded at rollout cover exactly the fed positions). Pre-training rows and
vision batches are wrapped as they are (`from_forward_batch`, `model_inputs`).

Fields (each [T] or [T, k], on the positions; present when the loss needs them):
    advantages_T          policy losses: the advantage of each position's token
    behaviour_logp_T      the rollout engine's log-prob of each token (TIS / IcePop corrections, the log-prob gap)
    reference_logp_T      the KL reference's log-probs
    teacher_logp_T        opd: the teacher's log-probs; student_logp_T: the student's, scored alike
    teacher_topk_ids_Tk   topk_kl: the teacher's top-k next tokens; teacher_topk_probs_Tk their renormalised probs
    token_weight_T        lm: a weight per token in place of the 1 / loss-token count

Legend: T packed positions, S sequences, M MoE layers, k experts per token (routes) or top-k entries.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from openk3.model.batch import ForwardBatch


@dataclass
class TokenBatch:
    targets_T: torch.Tensor  # long; the token position t predicts (IGNORE_INDEX where none)
    loss_mask_T: torch.Tensor  # bool; the positions the loss counts
    lengths: list[int]  # positions per sequence (they sum to T)
    input_ids_T: torch.Tensor | None = None  # the fed tokens (None when `prebuilt` or `model_inputs` feeds the model)
    routed_experts_TMk: torch.Tensor | None = None  # the rollout's routes of every fed position (routing replay)
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    prebuilt: ForwardBatch | None = None  # a pre-training row batch, as the layout cut it (context parallel)
    model_inputs: dict | None = None  # vision batches: `model(**model_inputs).logits` is [R, L, V]
    padding: bool = False  # TokenBatch.padding_batch(): counts for nothing
    # A context-parallel shard (`context_shard`): `lengths` are the pieces of sequences this rank holds,
    # `sequence_ids` the sequence (of the whole batch's `num_sequences`) of each piece, `context_parallel` the
    # ShardLayout whose group holds the other pieces, `first_mask_T` the first loss position of each whole sequence.
    sequence_ids: list[int] | None = None
    num_sequences: int | None = None
    context_parallel: Any = None
    first_mask_T: torch.Tensor | None = None

    @property
    def seq_T(self) -> torch.Tensor:
        """The sequence (0..S-1) of every position."""
        ids = torch.arange(len(self.lengths)) if self.sequence_ids is None else torch.tensor(self.sequence_ids)
        return torch.repeat_interleave(ids, torch.tensor(self.lengths, dtype=torch.long))

    @property
    def replicas(self) -> int:
        """How many ranks hold each sequence (a piece each): a per-sequence value computed from `reduce_sequences`
        is the same on all of them."""
        return 1 if self.context_parallel is None else self.context_parallel.cp.world

    def reduce_sequences(self, x_S: torch.Tensor) -> torch.Tensor:
        """Per-sequence partial sums [S] of this rank's pieces -> the whole sequences' sums (through autograd)."""
        return x_S if self.context_parallel is None else self.context_parallel.cp.sum(x_S, "sequence_sums")

    @property
    def num_positions(self) -> int:
        return int(self.targets_T.numel())

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], masks: list[list[bool]], *,
                       fields: dict[str, list[torch.Tensor]] | None = None,
                       routes: list[torch.Tensor] | None = None) -> TokenBatch:  # fmt: skip
        """Sequences of >= 2 tokens packed: `masks[i][t]` says whether token t counts (entry 0 is never scored);
        `fields[name][i]` holds sequence i's values at its positions ([n - 1] or [n - 1, k]); `routes[i]` its
        recorded routes, [>= n - 1, M, k] (rows past n - 1 unused)."""
        short = [i for i, s in enumerate(sequences) if len(s) < 2]
        if short:
            raise ValueError(f"sequences {short} have fewer than 2 tokens: nothing to score")
        lengths = [len(s) - 1 for s in sequences]
        input_ids_T = torch.tensor([t for s in sequences for t in s[:-1]], dtype=torch.long)
        targets_T = torch.tensor([t for s in sequences for t in s[1:]], dtype=torch.long)
        mask_T = torch.tensor([m for mask in masks for m in mask[1:]], dtype=torch.bool)
        packed = {name: torch.cat(list(parts)) for name, parts in (fields or {}).items()}
        routes_TMk = None if routes is None else packed_routes(routes, lengths)
        return cls(targets_T, mask_T, lengths, input_ids_T, routes_TMk, packed)

    @classmethod
    def padding_batch(cls, positions: int = 1) -> TokenBatch:
        """Positions that count for nothing: a rank with fewer micro-batches than the others runs them, so every
        rank makes the same collectives (expert all-to-alls, FSDP gathers) in the same order."""
        zero = torch.zeros(positions, dtype=torch.long)
        return cls(zero, torch.zeros(positions, dtype=torch.bool), [positions], zero, padding=True)

    def context_shard(self, cp, device: torch.device) -> TokenBatch:
        """This rank's contiguous piece of the packed positions over the context-parallel group `cp`
        (parallel/cp.py ContextParallel.shard: the sequences are the documents of one row), with its fields, routes
        and the first loss position of every sequence cut alike; the model runs it through `prebuilt`."""
        fb = cp.shard(self.input_ids_T[None].to(device), [self.lengths])
        lay = fb.context_parallel
        start, end = lay.start, lay.start + lay.lengths[cp.rank]
        if self.routed_experts_TMk is not None:
            fb.routed_experts = self.routed_experts_TMk[start:end].to(device)
        bounds = [0, *itertools.accumulate(self.lengths)]
        ids = [i for i, (a, b) in enumerate(itertools.pairwise(bounds)) if a < end and b > start]
        # A sequence's first loss position, found on the whole batch: a piece cannot tell whether an earlier one has it.
        seq_T, mask_T, T = self.seq_T, self.loss_mask_T.cpu(), self.loss_mask_T.numel()
        idx = torch.nonzero(mask_T).squeeze(-1)
        first_S = torch.full((len(self.lengths),), T).scatter_reduce(0, seq_T[idx], idx, "amin")
        first_T = torch.zeros(T + 1, dtype=torch.bool).index_fill(0, first_S, True)[:T]  # slot T: no loss position
        cut = slice(start, end)
        return TokenBatch(self.targets_T[cut], self.loss_mask_T[cut], fb.seq_lens, None, None,
                          {k: v[cut] for k, v in self.fields.items()}, prebuilt=fb, padding=self.padding,
                          sequence_ids=ids, num_sequences=len(self.lengths), context_parallel=lay,
                          first_mask_T=first_T[cut].to(device))  # fmt: skip

    def forward_batch(self, device: torch.device) -> ForwardBatch:
        if self.prebuilt is not None:
            return self.prebuilt
        routes = None if self.routed_experts_TMk is None else self.routed_experts_TMk.to(device)
        return ForwardBatch.from_lengths(self.input_ids_T.to(device), self.lengths, routed_experts=routes)

    def to(self, device: torch.device) -> TokenBatch:
        """The per-token tensors the loss reads on `device` (the fed tokens and routes move in forward_batch)."""
        first = None if self.first_mask_T is None else self.first_mask_T.to(device)
        return TokenBatch(self.targets_T.to(device), self.loss_mask_T.to(device), self.lengths, self.input_ids_T,
                          self.routed_experts_TMk, {k: v.to(device) for k, v in self.fields.items()}, self.prebuilt,
                          self.model_inputs, self.padding, self.sequence_ids, self.num_sequences,
                          self.context_parallel, first)  # fmt: skip

    @staticmethod
    def cat(batches: list[TokenBatch]) -> TokenBatch:
        """The batches' positions and fields one after another (sequences renumbered in order); no model inputs."""
        names = set.intersection(*(set(b.fields) for b in batches)) if batches else set()
        return TokenBatch(torch.cat([b.targets_T for b in batches]), torch.cat([b.loss_mask_T for b in batches]),
                          [n for b in batches for n in b.lengths],
                          fields={k: torch.cat([b.fields[k] for b in batches]) for k in sorted(names)})  # fmt: skip


def packed_routes(routed_experts: list[torch.Tensor | None], fed: list[int],
                  device: torch.device | str = "cpu") -> torch.Tensor | None:  # fmt: skip
    """Each sequence's recorded routes cut to its `fed` positions and packed: [T, M, k] int64 on `device`, or None
    when every entry is None (natural routing). Replay is all or nothing: a mix raises ValueError."""
    if len(routed_experts) != len(fed):
        raise ValueError(f"routed_experts has {len(routed_experts)} entries for {len(fed)} sequences")
    given = [r is not None for r in routed_experts]
    if not any(given):
        return None
    if not all(given):
        missing = [i for i, g in enumerate(given) if not g]
        raise ValueError(f"routed_experts is None for sequences {missing} but given for others: mixed replay and "
                         "natural routing in one forward is not supported")  # fmt: skip
    rows = []
    for i, (r_PMk, n) in enumerate(zip(routed_experts, fed)):
        if r_PMk.dim() != 3 or r_PMk.shape[0] < n:
            raise ValueError(f"routed_experts[{i}] must be [>= {n}, M, k] for a sequence of {n + 1} tokens, got "
                             f"shape {tuple(r_PMk.shape)}")  # fmt: skip
        rows.append(r_PMk[:n].to(device=device, dtype=torch.long))
    return torch.cat(rows)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive index runs of `lengths` whose sums stay within `max_tokens` (a longer sequence is alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not out or total + n > max_tokens:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out
