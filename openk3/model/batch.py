"""ForwardBatch: the model's internal input. Tokens are packed into one flat row of T tokens; `cu_seqlens` marks
where each of the N sequences starts. The user-facing `K3ForCausalLM.forward(input_ids, attention_mask, cache)`
builds one by dropping padding, and scatters the packed logits back. `mode` says what the forward does with the
cache (`Mode`); `context_parallel` carries a context-parallel shard's layout and exchanges (parallel/cp.py).

Layers that need whole sequences (the KDA conv and recurrence, MLA attention) view the packed tokens as a
right-padded [N, L, ...] block with `to_padded` / `to_packed`; the padded rows are made neutral by each layer.

Legend: T packed tokens, N sequences, L longest new length of any sequence in this call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch


class Mode(str, Enum):
    """What a forward does with the cache; layers branch on it at the top of `forward` (STYLE rule 7).

    FULL: no cache (training, plain prefill, a context-parallel shard). EXTEND: new tokens of any lengths on top of
    a cache (chunked prefill, mixed prefill + decode). DECODE: exactly one new token per sequence on a cache.
    VERIFY: speculative verification, equal lengths on a cache, no state written (spec/serving.md §4); only ever
    asked for, never inferred.
    """

    FULL = "full"
    EXTEND = "extend"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class ForwardBatch:
    input_ids_T: torch.Tensor
    cu_seqlens: torch.Tensor  # [N+1] int64, cumulative new-token counts
    cache: Any = None  # a model.cache.K3Cache with N sequences, or None
    # Training packs documents into rows of `row_len` tokens; attention can then run per row with a document mask
    # instead of per document. None: sequences are not grouped into rows.
    row_len: int | None = None
    # None: inferred from the cache and the lengths (full / decode / extend); VERIFY is only ever asked for.
    mode: Mode | None = None
    # Context parallelism's per-step layout and exchanges: an object built by `parallel/cp.py` (`ContextParallel.
    # shard`), whose methods the layers call at their hand-off points; None on one rank.
    context_parallel: Any = None
    # Routing replay (spec/rl.md §3): [T, M, k] integer (int16 or int64), the experts each packed token uses at
    # each of the M MoE layers (model.moe.moe_layer_indices; dense layers have no entry), instead of the biased
    # top-k; the weights are still recomputed from the router. Any order per token (used sorted ascending).
    # Checked against the model by K3Model.forward. None: natural routing.
    routed_experts: torch.Tensor | None = None
    seq_lens: list[int] = field(init=False)
    max_len: int = field(init=False)
    uniform: bool = field(init=False)
    _gather: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.seq_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        self.max_len = max(self.seq_lens, default=0)
        self.uniform = all(n == self.max_len for n in self.seq_lens)
        self.mode = infer_mode(self.cache is not None, self.seq_lens) if self.mode is None else Mode(self.mode)
        if self.mode is not Mode.FULL and self.cache is None:
            raise ValueError(f"mode {self.mode.value} needs a cache")
        if self.mode is Mode.FULL and self.cache is not None:
            raise ValueError("mode full runs without a cache")
        one_each = self.uniform and self.max_len == 1
        if self.mode is Mode.DECODE and not one_each or self.mode is Mode.VERIFY and not self.uniform:
            raise ValueError(f"mode {self.mode.value} does not fit the new-token lengths {self.seq_lens}")

    @classmethod
    def from_lengths(
        cls,
        input_ids_T: torch.Tensor,
        seq_lens: list[int],
        cache: Any = None,
        row_len: int | None = None,
        mode: Mode | None = None,
        routed_experts: torch.Tensor | None = None,
    ) -> ForwardBatch:
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.long).cumsum(0)
        return cls(input_ids_T, cu, cache, row_len, mode, routed_experts=routed_experts)

    @classmethod
    def from_rows(cls, input_ids_RL: torch.Tensor, doc_lens: list[list[int]]) -> ForwardBatch:
        """Rows of packed documents: `doc_lens[r]` are the document lengths of row r, summing to the row length."""
        _R, L = input_ids_RL.shape
        for r, lens in enumerate(doc_lens):
            if sum(lens) != L or min(lens, default=0) <= 0:
                raise ValueError(f"row {r}: document lengths {lens} must be positive and sum to the row length {L}")
        return cls.from_lengths(input_ids_RL.reshape(-1), [n for lens in doc_lens for n in lens], row_len=L)

    def segment_ids(self, device: torch.device) -> torch.Tensor:
        """[R, L] document index of every token of the row view (valid when `row_len` is set)."""
        seg = torch.repeat_interleave(
            torch.arange(self.num_seqs, device=device), torch.tensor(self.seq_lens, device=device)
        )
        return seg.view(-1, self.row_len)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def valid_mask(self, device: torch.device) -> torch.Tensor:
        """[N, L] bool, True at real (non-padding) positions of the right-padded view."""
        lens = torch.tensor(self.seq_lens, device=device)
        return torch.arange(self.max_len, device=device)[None, :] < lens[:, None]

    def _padded_index(self, device: torch.device) -> torch.Tensor:
        if self._gather is None or self._gather.device != device:
            self._gather = self.valid_mask(device).reshape(-1).nonzero().squeeze(-1)
        return self._gather

    def to_padded(self, x_T: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [N, L, ...] with zeros in the padding."""
        if self.uniform:
            return x_T.reshape(self.num_seqs, self.max_len, *x_T.shape[1:])
        out = x_T.new_zeros(self.num_seqs * self.max_len, *x_T.shape[1:])
        out = out.index_copy(0, self._padded_index(x_T.device), x_T)
        return out.reshape(self.num_seqs, self.max_len, *x_T.shape[1:])

    def to_packed(self, x_NL: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [T, ...], dropping the padding."""
        flat = x_NL.reshape(self.num_seqs * self.max_len, *x_NL.shape[2:])
        return flat if self.uniform else flat.index_select(0, self._padded_index(x_NL.device))


def infer_mode(has_cache: bool, seq_lens: list[int]) -> Mode:
    """The mode a batch of these new-token lengths runs in when the caller does not say: no cache is full, one
    token per sequence on a cache is decode, anything else on a cache is extend."""
    if not has_cache:
        return Mode.FULL
    return Mode.DECODE if seq_lens and all(n == 1 for n in seq_lens) else Mode.EXTEND
