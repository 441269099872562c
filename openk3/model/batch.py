"""ForwardBatch: the model's internal input. Tokens are packed into one flat row of T tokens; `cu_seqlens` marks
where each of the N sequences starts. The user-facing `K3ForCausalLM.forward(input_ids, attention_mask, cache)`
builds one by dropping padding, and scatters the packed logits back.

Layers that need whole sequences (the KDA conv and recurrence, MLA attention) view the packed tokens as a
right-padded [N, L, ...] block with `to_padded` / `to_packed`; the padded rows are made neutral by each layer.

Legend: T packed tokens, N sequences, L longest new length of any sequence in this call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    input_ids_T: torch.Tensor
    cu_seqlens: torch.Tensor  # [N+1] int64, cumulative new-token counts
    cache: Any = None  # a model.cache.K3Cache with N sequences, or None
    # Training packs documents into rows of `row_len` tokens; attention can then run per row with a document mask
    # instead of per document. None: sequences are not grouped into rows.
    row_len: int | None = None
    # Speculative verification (serving): every sequence holds its last accepted token plus its drafts. KDA layers
    # then run the decode step token by token on a register copy of the state, record each step's inputs through
    # the cache (`record`) and write no state; the engine folds the accepted prefix afterwards (spec/serving.md §4).
    verify: bool = False
    seq_lens: list[int] = field(init=False)
    max_len: int = field(init=False)
    uniform: bool = field(init=False)
    _gather: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.seq_lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        self.max_len = max(self.seq_lens, default=0)
        self.uniform = all(n == self.max_len for n in self.seq_lens)

    @classmethod
    def from_lengths(
        cls,
        input_ids_T: torch.Tensor,
        seq_lens: list[int],
        cache: Any = None,
        row_len: int | None = None,
        verify: bool = False,
    ) -> ForwardBatch:
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(seq_lens, dtype=torch.long).cumsum(0)
        return cls(input_ids_T, cu, cache, row_len, verify)

    @classmethod
    def from_rows(cls, input_ids_RL: torch.Tensor, doc_lens: list[list[int]]) -> ForwardBatch:
        """Rows of packed documents: `doc_lens[r]` are the document lengths of row r, summing to the row length."""
        R, L = input_ids_RL.shape
        for r, lens in enumerate(doc_lens):
            if sum(lens) != L or min(lens, default=0) <= 0:
                raise ValueError(f"row {r}: document lengths {lens} must be positive and sum to the row length {L}")
        return cls.from_lengths(input_ids_RL.reshape(-1), [n for lens in doc_lens for n in lens], row_len=L)

    def segment_ids(self, device: torch.device) -> torch.Tensor:
        """[R, L] document index of every token of the row view (valid when `row_len` is set)."""
        seg = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), torch.tensor(self.seq_lens, device=device))
        return seg.view(-1, self.row_len)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence on top of a cache: the released code's recurrent (decode) path."""
        return self.cache is not None and self.max_len == 1 and self.uniform

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
