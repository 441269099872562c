"""The token stream of a corpus and the resumable loader that cuts `PackedBatch`es from it.

- `TokenStream`: every document's token ids, flat (`tokens [T] int32`), with `offsets [D + 1] int64` marking where
  each document starts; no bos/eos stored (the packer adds them).
- `tokenize_documents(docs, tokenizer, cache_dir)`: builds a `TokenStream` once, with a progress bar, and caches it
  as safetensors keyed by a hash of the tokenizer and the corpus. Pure speed-up: a cache hit returns the same tokens.
- `TokenLoader`: an endless, deterministic stream of batches. Epoch e visits the documents in a permutation seeded by
  (seed, e), each wrapped as `[bos] + ids + [eos]`; the epochs are concatenated into one infinite stream and rows are
  cut from it exactly as `packing.pack_documents` does (row = L + 1 tokens at stride L, labels never cross a
  document boundary). The whole loader state is one integer, the stream position of the next row, so resuming,
  changing seq_len and changing the number of data-parallel ranks all continue the same token stream.

Legend: T tokens in the corpus, D documents, S = T + 2D tokens per epoch (wrapped), B rows per batch, L seq_len.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from openk3.data.packing import PackedBatch, pad_window, stack_rows, window_to_row

CACHE_FORMAT = 1  # bump when the cached layout changes


@dataclass
class TokenStream:
    tokens: torch.Tensor  # [T] int32, documents back to back
    offsets: torch.Tensor  # [D + 1] int64, document d is tokens[offsets[d]:offsets[d + 1]]

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def doc(self, d: int) -> torch.Tensor:
        return self.tokens[self.offsets[d] : self.offsets[d + 1]]


def corpus_key(docs, tokenizer) -> str:
    """Hash of the tokenizer's fingerprint and every document's source and text (order matters)."""
    h = hashlib.sha256(f"openk3-tokens-v{CACHE_FORMAT}\0{tokenizer.fingerprint}\0".encode())
    for doc in docs:
        for part in (doc.source, doc.text):
            data = part.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()


def tokenize_documents(
    docs, tokenizer, cache_dir: str | os.PathLike | None = None, progress: bool = True, chunk_docs: int = 64
) -> TokenStream:
    """Tokenize `docs` (a list of `corpus.Document`) with `tokenizer.encode_batch`, or load the cached result from
    `cache_dir/tokens-<key>.safetensors` when the tokenizer and corpus are unchanged."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    file = None
    if cache_dir is not None:
        file = os.path.join(cache_dir, f"tokens-{corpus_key(docs, tokenizer)[:32]}.safetensors")
        if os.path.exists(file):
            cached = load_file(file)
            return TokenStream(cached["tokens"], cached["offsets"])

    lengths, parts = [0], []
    total = sum(len(d.text) for d in docs)
    with tqdm(total=total, unit="char", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
        for i in range(0, len(docs), chunk_docs):
            chunk = docs[i : i + chunk_docs]
            for ids in tokenizer.encode_batch([d.text for d in chunk]):
                parts.append(np.asarray(ids, dtype=np.int32))
                lengths.append(len(ids))
            bar.update(sum(len(d.text) for d in chunk))
    tokens = torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32))
    stream = TokenStream(tokens, torch.tensor(np.cumsum(lengths), dtype=torch.long))
    if file is not None:
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{file}.{os.getpid()}.tmp"  # write then rename, so a killed run never leaves a truncated cache
        tensors = {"tokens": stream.tokens, "offsets": stream.offsets}
        save_file(tensors, tmp, metadata={"tokenizer": tokenizer.fingerprint})
        os.replace(tmp, file)
    return stream


class TokenLoader:
    """Deterministic, resumable batches of `batch_size` rows of `seq_len` tokens from a `TokenStream`.

    `loop=True` (training): endless, a fresh document permutation per epoch (`shuffle=False` keeps corpus order).
    `loop=False` (evaluation): one pass over the documents; the tail is padded and the last batch filled with
    all-padding rows, then iteration stops. With `world_size` data-parallel ranks, each step takes
    `world_size * batch_size` consecutive rows and rank r gets rows [r * batch_size, (r + 1) * batch_size).

    `random_windows=True` (training): every row is a window of the (epoch-0-anchored, infinite) stream starting at a
    position drawn from (seed, global row index) instead of the next consecutive window. Consecutive rows of one
    document make a batch of a few documents only, whose content-specific routing skew dwarfs the balancing noise
    of independent tokens; random windows give every row its own place in the corpus. The state is then the number
    of rows drawn, so resuming and changing seq_len or batch_size still continue the same sequence of windows.
    """

    def __init__(
        self, stream: TokenStream, batch_size: int, seq_len: int, bos_id: int, eos_id: int, pad_id: int,
        seed: int = 0, shuffle: bool = True, loop: bool = True, rank: int = 0, world_size: int = 1,
        random_windows: bool = False,
    ):  # fmt: skip
        if stream.num_docs == 0:
            raise ValueError("TokenLoader: the token stream has no documents")
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"TokenLoader: need batch_size >= 1 and 0 <= rank < world_size, got "
                             f"{batch_size}, {rank}, {world_size}")  # fmt: skip
        self.stream, self.batch_size = stream, batch_size
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.seed, self.shuffle, self.loop = seed, shuffle, loop
        self.rank, self.world_size = rank, world_size
        self.wrapped_lens = (stream.offsets[1:] - stream.offsets[:-1]).numpy() + 2  # [D]
        self.epoch_tokens = int(self.wrapped_lens.sum())  # S
        self.cursor = 0  # stream position of the next step's first row
        self.random_windows = random_windows
        self.rows_drawn = 0  # random_windows: global index of the next step's first row
        if random_windows and not loop:
            raise ValueError("TokenLoader: random_windows needs loop=True")
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None
        self.set_seq_len(seq_len)

    def set_seq_len(self, seq_len: int) -> None:
        """Change the row length (context-length curriculum). The cursor is a token position in the stream, not a
        row count, so the next batch starts at the token where the last one stopped (the last label of the previous
        row is the first input of the next): no token is skipped or repeated, and the document order is unchanged.
        Only the cut points move: rows are cut at stride `seq_len` from the cursor on."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len = seq_len

    @property
    def epoch(self) -> int:
        return self.cursor // self.epoch_tokens

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seq_len": self.seq_len, "seed": self.seed, "shuffle": self.shuffle,
                "epoch_tokens": self.epoch_tokens, "num_docs": self.stream.num_docs, "rows_drawn": self.rows_drawn}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where the saved loader stopped (also with a different world_size or batch_size)."""
        mine = self.state_dict()
        for key in ("seed", "shuffle", "epoch_tokens", "num_docs"):
            if state[key] != mine[key]:
                raise ValueError(f"loader state has {key}={state[key]}, this loader has {mine[key]}: the corpus, "
                                 f"tokenizer or seed differs from the run that saved it")  # fmt: skip
        self.cursor = int(state["cursor"])
        self.rows_drawn = int(state.get("rows_drawn", 0))
        self.set_seq_len(int(state["seq_len"]))

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> PackedBatch:
        L, B = self.seq_len, self.batch_size
        end = None if self.loop else self.epoch_tokens
        if end is not None and self.cursor >= end - 1:
            raise StopIteration
        rows = []
        if self.random_windows:
            for i in range(self.rank * B, (self.rank + 1) * B):
                start = int(np.random.default_rng([self.seed, 1, self.rows_drawn + i]).integers(self.epoch_tokens))
                rows.append(window_to_row(*self._window(start, start + L + 1)))
            self.rows_drawn += self.world_size * B
            return stack_rows(rows)
        for i in range(self.rank * B, (self.rank + 1) * B):
            start = self.cursor + i * L
            if end is not None and start >= end - 1:
                window_N = torch.full((L + 1,), self.pad_id, dtype=torch.long)
                doc_N = torch.full((L + 1,), -1, dtype=torch.long)
            else:
                stop = start + L + 1 if end is None else min(start + L + 1, end)
                window_N, doc_N = self._window(start, stop)
                if len(window_N) < L + 1:
                    window_N, doc_N = pad_window(window_N, doc_N, L + 1, self.pad_id)
            rows.append(window_to_row(window_N, doc_N))
        self.cursor += self.world_size * B * L
        return stack_rows(rows)

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order [D], wrapped start of each visited document within the epoch [D + 1])."""
        if self._epoch is None or self._epoch[0] != epoch:
            D = self.stream.num_docs
            # SeedSequence of (seed, epoch): independent, platform-stable permutations per epoch.
            order = np.random.default_rng([self.seed, epoch]).permutation(D) if self.shuffle else np.arange(D)
            starts = np.zeros(D + 1, dtype=np.int64)
            np.cumsum(self.wrapped_lens[order], out=starts[1:])
            self._epoch = (epoch, order, starts)
        return self._epoch[1], self._epoch[2]

    def _window(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stream tokens [start, stop) and their document ids (unique over the infinite stream: epoch * D + k)."""
        tokens, docs = [], []
        pos = start
        while pos < stop:
            epoch, offset = divmod(pos, self.epoch_tokens)
            order, starts = self._order(epoch)
            k = int(np.searchsorted(starts, offset, side="right")) - 1
            d = int(order[k])
            n = int(self.wrapped_lens[d])  # len(ids) + 2
            a = offset - int(starts[k])  # [a, b): the part of the wrapped document in this window
            b = min(n, a + stop - pos)
            body = self.stream.doc(d)[max(a - 1, 0) : min(b - 1, n - 2)].long()
            piece = torch.cat([
                torch.tensor([self.bos_id] if a == 0 else [], dtype=torch.long), body,
                torch.tensor([self.eos_id] if b == n else [], dtype=torch.long),
            ])  # fmt: skip
            tokens.append(piece)
            docs.append(torch.full((len(piece),), epoch * self.stream.num_docs + k, dtype=torch.long))
            pos += len(piece)
        return torch.cat(tokens), torch.cat(docs)
