"""Document packing: tokenized documents -> fixed-shape `PackedBatch`es whose rows carry their document segments.

Each document is wrapped as `[bos] + ids + [eos]` and the wrapped documents are concatenated into one stream. A row
is a window of L + 1 consecutive stream tokens: inputs = window[:-1], labels = window[1:]. Consecutive rows overlap
by one token (row r starts at stream position r * L), so every stream token after the first is a label exactly once.

Document boundaries:
- `doc_lens[b]` lists the lengths of the document segments of row b's inputs, in order; they sum to L. The model
  turns them into `cu_seqlens`, so KDA resets its state and MLA attends only within a segment.
- A document longer than the room left in a row continues in the next row as a new segment: its state resets
  there and its continuation does not see the part in the previous row (the price of fixed rows; a longer seq_len
  keeps more of each document together).
- A label is -100 wherever input token t and label token t + 1 belong to different documents (the `eos -> bos`
  transition), so no loss crosses a boundary, and wherever the label is padding. Padding (only at the end of a
  finite stream) is its own segment.

Legend: B rows per batch, L tokens per row (seq_len), N = L + 1 tokens per window.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
PAD_DOC = -1  # document id of padding positions


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, L] long
    labels: torch.Tensor  # [B, L] long, IGNORE_INDEX where no loss
    doc_lens: list[list[int]]  # per row, the segment lengths in order; each row sums to L
    answer_mask: torch.Tensor | None = None  # [B, L] bool, synthetic tasks only: True where labels holds an answer

    def cu_seqlens(self) -> torch.Tensor:
        """[S + 1] int64 cumulative segment lengths over the flattened B * L tokens (rows never share a segment),
        the `cu_seqlens` of `ForwardBatch(input_ids.reshape(-1), cu_seqlens)`."""
        lens = torch.tensor([n for row in self.doc_lens for n in row], dtype=torch.long)
        return torch.nn.functional.pad(lens.cumsum(0), (1, 0))

    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)
        return PackedBatch(move(self.input_ids), move(self.labels), self.doc_lens, move(self.answer_mask))


def window_to_row(window_N: torch.Tensor, doc_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One row from a window of L + 1 tokens and their document ids (PAD_DOC for padding):
    (input_ids [L], labels [L], doc_lens). Segments are maximal runs of one document id among the inputs."""
    input_L, label_L = window_N[:-1].long(), window_N[1:].long()
    doc_in, doc_out = doc_N[:-1], doc_N[1:]
    no_loss = (doc_in != doc_out) | (doc_out == PAD_DOC)
    labels_L = label_L.masked_fill(no_loss, IGNORE_INDEX)
    # Segment starts: position 0 and every position whose document differs from the one before it.
    change = torch.ones_like(doc_in, dtype=torch.bool)
    change[1:] = doc_in[1:] != doc_in[:-1]
    starts = change.nonzero().squeeze(-1).tolist() + [len(doc_in)]
    doc_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    return input_L, labels_L, doc_lens


def stack_rows(rows: list[tuple[torch.Tensor, torch.Tensor, list[int]]]) -> PackedBatch:
    return PackedBatch(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]), [r[2] for r in rows])


def wrap_documents(
    docs: Iterable[list[int] | torch.Tensor], bos_id: int, eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stream of `[bos] + ids + [eos]` documents: (tokens [S] long, doc ids [S] long, 0-based in input order)."""
    tokens, ids = [], []
    for d, doc in enumerate(docs):
        doc = torch.as_tensor(doc, dtype=torch.long)
        tokens.append(torch.cat([doc.new_tensor([bos_id]), doc, doc.new_tensor([eos_id])]))
        ids.append(torch.full((len(doc) + 2,), d, dtype=torch.long))
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(tokens), torch.cat(ids)


def pack_documents(
    docs: Iterable[list[int] | torch.Tensor], seq_len: int, batch_size: int, bos_id: int, eos_id: int, pad_id: int,
    drop_last: bool = False,
) -> Iterator[PackedBatch]:  # fmt: skip
    """Pack tokenized documents (in the given order) into batches of `batch_size` rows of `seq_len` tokens.

    The in-memory packer for evaluation and tests; `loader.TokenLoader` cuts the same rows from a token stream with
    shuffling and resumable state. With `drop_last=False` the stream's tail is padded with `pad_id` (labels -100,
    a padding segment) and the last batch is filled with all-padding rows, so every batch is [batch_size, seq_len]
    and every label token of the stream is seen once."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be >= 1, got {seq_len} and {batch_size}")
    tokens_S, doc_S = wrap_documents(docs, bos_id, eos_id)
    rows = []
    for start in range(0, max(len(tokens_S) - 1, 0), seq_len):
        window_N, doc_N = tokens_S[start : start + seq_len + 1], doc_S[start : start + seq_len + 1]
        if len(window_N) < seq_len + 1:
            if drop_last:
                break
            window_N, doc_N = pad_window(window_N, doc_N, seq_len + 1, pad_id)
        rows.append(window_to_row(window_N, doc_N))
        if len(rows) == batch_size:
            yield stack_rows(rows)
            rows = []
    if rows and not drop_last:
        empty_N = torch.full((seq_len + 1,), PAD_DOC, dtype=torch.long)
        while len(rows) < batch_size:
            rows.append(window_to_row(empty_N.clone().fill_(pad_id), empty_N))
        yield stack_rows(rows)


def pad_window(window: torch.Tensor, doc: torch.Tensor, length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad a short window (and its document ids, with PAD_DOC) to `length`."""
    missing = length - len(window)
    return (
        torch.cat([window.long(), torch.full((missing,), pad_id, dtype=torch.long)]),
        torch.cat([doc.long(), torch.full((missing,), PAD_DOC, dtype=torch.long)]),
    )
