"""VisionRunData: what `k3 train --preset tiny-vl --data vision` reads: the embedded image-text tasks of
`openk3.data.vision_tasks`, image and text in one token stream from the first step.

One example is one sequence, in the pre-training stream form (not a chat: K3 pre-trains on interleaved image-text
by next-token prediction):

    [BOS] <|media_begin|>image WxH<|media_content|> <|media_pad|> x N <|media_end|> {prompt} {answer} <|end_of_msg|>

with the N = (h/2)(w/2) image rows already in place (the vLLM convention of `K3ForConditionalGeneration`, so
nothing grows inside the model). The loss is on the answer and the end-of-message token only: text tokens, never
image rows or the prompt. A batch keeps its examples packed (one stream and their lengths, `forward_batch`) and
gives them right-padded (`padded`), which the trainer and the evaluation use: the model is causal, so padding
after an example's last token changes nothing before it, and the padded forward is about 20% faster on CPU than
the packed varlen one at these lengths (32 examples of ~40 tokens: 1.0 s against 1.2-1.3 s per training step).
The price: the router balancer also counts the pad tokens (about 6% of a step's tokens).

Example i of a run is example i of the ("train", seed) stream (`vision_tasks.example`), so the data position is
the number of examples drawn. Held-out examples come from the ("heldout", seed) stream (`heldout`). The tokenizer
is a byte-level BPE trained on the task's own prompts and scene answers (`task_tokenizer`; deterministic, saved
with the checkpoint), or bytes with `--tokenizer byte`.

Legend: B examples, T packed tokens, L patches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from openk3.data import vision_tasks as vt
from openk3.data.packing import IGNORE_INDEX
from openk3.data.tokenizer import NUM_SPECIAL_TOKENS, ByteTokenizer, load_tokenizer, train_bpe
from openk3.data.vision import num_image_tokens, preprocess
from openk3.model.batch import ForwardBatch

BPE_EXAMPLES = 4000  # prompts the BPE is trained on: every prompt and scene answer occurs many times
# K3's media markers, as offsets from the first special id (data/tokenizer.K3_SPECIAL_NAMES).
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = 18, 19, 20


@dataclass
class VisionBatch:
    input_ids: torch.Tensor  # [T] long: the examples packed, image rows as N placeholders each
    labels: torch.Tensor  # [T] long: labels[t] is the target of logits[t] (shifted), IGNORE_INDEX elsewhere
    seq_lens: list[int]  # [B] the examples' lengths, summing to T
    pixel_values: torch.Tensor  # [L, 3, p, p] the processor's patches of the B images
    grid_thws: torch.Tensor  # [B, 3]
    examples: list[vt.VisionExample]

    def num_loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def forward_batch(self, device="cpu") -> ForwardBatch:
        return ForwardBatch.from_lengths(self.input_ids.to(device), self.seq_lens)

    def padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [B, T_max] right-padded with `pad_id`, labels [B, T_max] with IGNORE_INDEX on the padding)."""
        ids = pad_sequence(self.input_ids.split(self.seq_lens), batch_first=True, padding_value=pad_id)
        return ids, pad_sequence(self.labels.split(self.seq_lens), batch_first=True, padding_value=IGNORE_INDEX)


def task_tokenizer(text_config, log=print):
    """A byte-level BPE with the model's vocabulary and K3's special layout, trained on the tasks' prompts and the
    scene answers, not on the text read off images: that text is left to small pieces (about 4 ids per word), so
    reading is learned letter by letter, shared across words and codes. A BPE trained on the word list as well makes
    200 of the 246 words single ids, and its answer loss stayed at the no-image level where the letter-level one kept
    falling (docs/notes.md)."""
    texts = []
    for i in range(BPE_EXAMPLES):
        ex = vt.example(i, seed=0, split="tokenizer")
        texts.append(ex.prompt if ex.kind == "text" else f"{ex.prompt} {ex.answer}")
    texts += [" ".join(vt.COLOURS), " ".join(vt.SHAPES)]
    special = {"bos": text_config.bos_token_id, "eos": text_config.eos_token_id, "pad": text_config.pad_token_id}
    tok = train_bpe(texts, text_config.vocab_size, special)
    per_word = sum(len(tok.encode(" " + w)) for w in vt.WORDS) / len(vt.WORDS)
    log(f"trained a {text_config.vocab_size}-id BPE on the vision tasks' prompts ({per_word:.1f} ids per word of the "
        f"text task)")  # fmt: skip
    return tok


class VisionEncoder:
    """Examples -> VisionBatch (module docstring), and the prompt part alone for generation."""

    def __init__(self, tokenizer, config, media_proc_cfg: dict | None = None):
        self.tokenizer, self.config = tokenizer, config
        self.media_proc_cfg = media_proc_cfg
        text = config.text_config
        base = text.vocab_size - NUM_SPECIAL_TOKENS
        self.begin, self.content, self.end = base + MEDIA_BEGIN, base + MEDIA_CONTENT, base + MEDIA_END
        self.placeholder = config.media_placeholder_token_id
        self.bos, self.eos, self.pad = text.bos_token_id, text.eos_token_id, text.pad_token_id

    def prompt_ids(self, ex: vt.VisionExample, rows: int) -> list[int]:
        enc = self.tokenizer.encode
        w, h = ex.image.size
        return [self.bos, self.begin, *enc(f"image {w}x{h}"), self.content, *([self.placeholder] * rows), self.end,
                *enc(ex.prompt)]  # fmt: skip

    def answer_ids(self, ex: vt.VisionExample) -> list[int]:
        return [*self.tokenizer.encode(" " + ex.answer), self.eos]

    def images(self, examples: list[vt.VisionExample]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        pixel_values, grid_thws = preprocess([ex.image for ex in examples], self.media_proc_cfg)
        return pixel_values, grid_thws, [num_image_tokens(g) for g in grid_thws]

    def batch(self, examples: list[vt.VisionExample]) -> VisionBatch:
        pixel_values, grid_thws, rows = self.images(examples)
        ids: list[int] = []
        labels: list[int] = []
        seq_lens = []
        for ex, n in zip(examples, rows):
            prompt, answer = self.prompt_ids(ex, n), self.answer_ids(ex)
            ids += prompt + answer
            # Shifted: position t predicts token t + 1, so the last prompt position predicts the first answer token
            # and the end-of-message position predicts nothing.
            labels += [IGNORE_INDEX] * (len(prompt) - 1) + answer + [IGNORE_INDEX]
            seq_lens.append(len(prompt) + len(answer))
        return VisionBatch(torch.tensor(ids), torch.tensor(labels), seq_lens, pixel_values, grid_thws, list(examples))


class VisionRunData:
    """The RunData of a vision run (same interface as train/data.RunData where the trainer uses it)."""

    synthetic = False
    unigram_loss = None

    def __init__(self, cfg, config, tokenizer_dir: str | None = None, log=print):
        self.cfg, self.config, self.log = cfg, config, log
        self.text = config.text_config
        self.kinds = cfg.vision_kinds_tuple
        if tokenizer_dir is not None:
            self.tokenizer = load_tokenizer(tokenizer_dir, self.text)
        elif cfg.tokenizer == "byte":
            t = self.text
            self.tokenizer = ByteTokenizer(t.vocab_size, t.bos_token_id, t.eos_token_id, t.pad_token_id)
        else:
            self.tokenizer = task_tokenizer(self.text, log)
        self.encoder = VisionEncoder(self.tokenizer, config)
        self.examples_drawn = 0
        self._heldout: list[vt.VisionExample] | None = None
        log(f"data: the embedded image-text tasks ({', '.join(self.kinds)}), drawn per step from the "
            f"('train', {cfg.seed}) stream; {cfg.vision_eval_examples} held-out examples")  # fmt: skip

    def train_examples(self, start: int, count: int) -> list[vt.VisionExample]:
        return [vt.example(start + i, self.cfg.seed, "train", self.kinds) for i in range(count)]

    def next_train_batch(self, rows: int, seq_len: int | None = None) -> VisionBatch:
        """The next `rows` training examples (seq_len is unused: a row is one example)."""
        examples = self.train_examples(self.examples_drawn, rows)
        self.examples_drawn += rows
        return self.encoder.batch(examples)

    def heldout(self) -> list[vt.VisionExample]:
        """The first `--vision-eval-examples` of the ("heldout", seed) stream. Not filtered against the training
        stream, which is unbounded (drawn per step): with random colours, positions, sizes and noise a pixel-equal
        pair is vanishingly unlikely, and tests/train/test_vision_train.py checks the first 5,000 training
        examples against the held-out set."""
        if self._heldout is None:
            n = self.cfg.vision_eval_examples
            self._heldout = [vt.example(i, self.cfg.seed, "heldout", self.kinds) for i in range(n)]
        return self._heldout

    def val_batches(self, rows: int, seq_len: int | None, count: int) -> list[VisionBatch]:
        examples = self.heldout()
        return [self.encoder.batch(examples[i : i + rows]) for i in range(0, min(len(examples), rows * count), rows)]

    def state_dict(self) -> dict:
        return {"examples_drawn": self.examples_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.examples_drawn = state["examples_drawn"]

    @torch.no_grad()
    def sample(self, model, max_new_tokens: int, prompt: str | None = None) -> str:
        """Greedy answers to three held-out examples, `prompt -> prediction (answer)`."""
        from openk3.train.vision_eval import greedy_answers

        examples = self.heldout()[:3]
        preds = greedy_answers(model, self.encoder, examples, max_new_tokens=min(max_new_tokens, 16))
        return "; ".join(f"{ex.prompt} -> {p!r} ({ex.answer!r})" for ex, p in zip(examples, preds))
