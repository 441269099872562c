"""RunData: what a training run reads. It owns the tokenizer, the train and validation token streams (or a
synthetic task), the resumable position in them, the evaluation batches and the unigram baseline.

- `--data stdlib` (default) or a path: documents -> deterministic train/validation split -> tokenizer (a byte-level
  BPE trained on the training split, or loaded from the checkpoint being resumed) -> cached token streams ->
  `TokenLoader` rows with document boundaries (KDA state resets, MLA masks across documents).
- `--data mqar | needle | copy | recall` (mqar and needle alternating): synthetic long-context recall tasks generated per step from (seed, step), so the
  data position is just the step counter.
"""

from __future__ import annotations

import os

import torch

from openk3.data.corpus import load_documents, split_train_val, stdlib_documents
from openk3.data.loader import TokenLoader, tokenize_documents
from openk3.data.packing import PackedBatch
from openk3.data.synthetic import copying, mqar, needle
from openk3.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

SYNTHETIC = ("mqar", "needle", "copy", "recall")
VAL_FRACTION = 0.05  # of documents; the default corpus then holds ~16 validation documents (~130 KB)
BPE_TRAIN_BYTES = 2_000_000  # enough text for a 1K-32K vocabulary; more only slows the tokenizer training


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "openk3", "tokens")


def documents(data: str):
    return stdlib_documents() if data == "stdlib" else load_documents(data)


def train_tokenizer_for(text_config, data: str = "stdlib", log=print):
    """A byte-level BPE with the model's vocabulary size and special ids, trained on the training split."""
    train_docs, _ = split_train_val(documents(data), val_fraction=VAL_FRACTION, seed=0)
    texts, total = [], 0
    for doc in train_docs:
        if total >= BPE_TRAIN_BYTES:
            break
        texts.append(doc.text)
        total += len(doc.text)
    log(f"training a {text_config.vocab_size}-id byte-level BPE on {total / 1e6:.1f} MB of {data}")
    special = {"bos": text_config.bos_token_id, "eos": text_config.eos_token_id, "pad": text_config.pad_token_id}
    return train_bpe(texts, text_config.vocab_size, special)


# Recall tasks draw keys and values from the first RECALL_VOCAB ids (Zoology's small-vocabulary MQAR setting): the
# skill measured is lookup, not learning hundreds of embeddings from the few answer tokens of each sequence.
RECALL_VOCAB = 64


def mqar_batch(rows: int, seq_len: int, text, seed: int) -> PackedBatch:
    # One pair per 16 tokens, at most RECALL_VOCAB // 4 (keys are distinct, drawn from half the recall vocabulary).
    pairs = min(max(2, seq_len // 16), RECALL_VOCAB // 4)
    vocab = (0, min(RECALL_VOCAB, text.bos_token_id))
    return mqar(rows, seq_len, pairs, pairs, vocab, text.bos_token_id, text.bos_token_id + 4, seed=seed)


def needle_batch(rows: int, seq_len: int, text, seed: int, depth: float | None = None) -> PackedBatch:
    if depth is None:  # training: a random depth per batch
        depth = float(torch.rand((), generator=torch.Generator().manual_seed(seed + 7)))
    half = min(RECALL_VOCAB, text.bos_token_id) // 2
    # Hay from the first half of the recall ids, the 2-token key and 2-token value from the second half: the key
    # occurs exactly twice (needle and query), so retrieval is well defined at any haystack length.
    return needle(rows, seq_len, depth, (0, half), text.bos_token_id, text.bos_token_id + 3, key_len=2, value_len=2,
                  seed=seed, kv_range=(half, 2 * half))  # fmt: skip


def copy_batch(rows: int, seq_len: int, text, seed: int) -> PackedBatch:
    return copying(rows, seq_len, (0, text.bos_token_id), text.bos_token_id, text.bos_token_id + 3,
                   text.pad_token_id, seed=seed)  # fmt: skip


def recall_batch(rows: int, seq_len: int, text, seed: int) -> PackedBatch:
    """MQAR and needle retrieval on alternate batches: the two recall skills the evaluation measures."""
    return (mqar_batch if seed % 2 else needle_batch)(rows, seq_len, text, seed)


TASKS = {"mqar": mqar_batch, "needle": needle_batch, "copy": copy_batch, "recall": recall_batch}


class RunData:
    def __init__(self, cfg, text_config, tokenizer_dir: str | None = None, log=print):
        self.cfg, self.text, self.log = cfg, text_config, log
        self.synthetic = cfg.data in SYNTHETIC
        self.batches_drawn = 0
        if tokenizer_dir is not None:
            self.tokenizer = load_tokenizer(tokenizer_dir, text_config)
        elif self.synthetic or cfg.tokenizer == "byte":
            t = text_config
            self.tokenizer = ByteTokenizer(t.vocab_size, t.bos_token_id, t.eos_token_id, t.pad_token_id)
        else:
            self.tokenizer = train_tokenizer_for(text_config, cfg.data, log)
        if self.synthetic:
            self.unigram_loss = None
            return
        train_docs, val_docs = split_train_val(documents(cfg.data), val_fraction=VAL_FRACTION, seed=0)
        if not val_docs:
            raise ValueError(f"--data {cfg.data}: too few documents for a validation split (need at least 2)")
        self.train_stream = tokenize_documents(train_docs, self.tokenizer, cache_dir(), progress=cfg.progress)
        self.val_stream = tokenize_documents(val_docs, self.tokenizer, cache_dir(), progress=False)
        t = text_config
        # Random windows: each row from its own place in the corpus, so a batch is not a few documents (whose
        # content skews expert loads far beyond the balancing noise of independent tokens; docs/notes.md).
        self.loader = TokenLoader(self.train_stream, 1, cfg.seq_len, t.bos_token_id, t.eos_token_id,
                                  t.pad_token_id, seed=cfg.seed, random_windows=True)  # fmt: skip
        self.unigram_loss = self._unigram_loss()
        log(f"data: {len(train_docs)} train / {len(val_docs)} validation documents, "
            f"{self.train_stream.num_tokens:,} / {self.val_stream.num_tokens:,} tokens; "
            f"unigram baseline {self.unigram_loss:.3f} nats/token")  # fmt: skip

    def _unigram_loss(self) -> float:
        """Cross-entropy of the validation tokens under the training unigram distribution (add-one smoothing):
        the loss a model that ignores context reaches."""
        V = self.text.vocab_size
        counts = torch.bincount(self.train_stream.tokens.long(), minlength=V).double() + 1.0
        logp = (counts / counts.sum()).log()
        return float(-logp[self.val_stream.tokens.long()].mean())

    def next_train_batch(self, rows: int, seq_len: int) -> PackedBatch:
        self.batches_drawn += 1
        if self.synthetic:
            seed = self.cfg.seed * 1_000_003 + self.batches_drawn
            return TASKS[self.cfg.data](rows, seq_len, self.text, seed)
        self.loader.batch_size = rows
        self.loader.set_seq_len(seq_len)
        return next(self.loader)

    def val_batches(self, rows: int, seq_len: int, count: int) -> list[PackedBatch]:
        """Fixed validation batches (the same every evaluation)."""
        if self.synthetic:
            return [TASKS[self.cfg.data](rows, seq_len, self.text, seed=10**9 + i) for i in range(count)]
        t = self.text
        loader = TokenLoader(self.val_stream, rows, seq_len, t.bos_token_id, t.eos_token_id, t.pad_token_id,
                             seed=0, shuffle=False, loop=False)  # fmt: skip
        out = []
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                break
        return out

    def state_dict(self) -> dict:
        state = {"batches_drawn": self.batches_drawn}
        if not self.synthetic:
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.batches_drawn = state["batches_drawn"]
        if not self.synthetic:
            self.loader.load_state_dict(state["loader"])

    @torch.no_grad()
    def sample(self, model, max_new_tokens: int, prompt: str | None = None) -> str:
        prompt = prompt if prompt is not None else ("def " if not self.synthetic else "")
        ids = self.tokenizer.encode(prompt, add_bos=True)
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, temperature=0.8,
                                 top_p=0.95, eos_token_id=self.text.eos_token_id, seed=self.cfg.seed)  # fmt: skip
        finally:
            model.train(was_training)
        return prompt + self.tokenizer.decode(out[0, len(ids) :].tolist())
