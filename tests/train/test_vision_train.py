"""`k3 train --preset tiny-vl`: the packed image-text batches, the packed multimodal forward against the padded
reference, the trainer's vision step (accumulation, exact resume, the tower's gradient norm), greedy evaluation, the
contrastive stage, and the config's checks."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from grad_match import assert_gradients_match
from train_helpers import QUIET, grads_of_one_step

from openk3.config import K3Config
from openk3.data import vision_tasks as vt
from openk3.data.packing import IGNORE_INDEX
from openk3.model.batch import ForwardBatch
from openk3.model.multimodal import K3ForConditionalGeneration
from openk3.train.config import TrainConfig
from openk3.train.contrastive import clip_loss
from openk3.train.trainer import Trainer
from openk3.train.vision_data import VisionEncoder, VisionRunData
from openk3.train.vision_eval import greedy_answers, score

SILENT = lambda *a, **k: None


def _cfg(out, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(preset="tiny-vl", batch_size=4, steps=4, eval_every=100, save_every=100,
                                 vision_eval_examples=6, out=str(out), **QUIET), **kw})  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return VisionRunData(_cfg(tmp_path_factory.mktemp("vd")), K3Config.preset("tiny-vl"), log=SILENT)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(K3Config.preset("tiny-vl"))
    m.init_weights(torch.Generator().manual_seed(3))
    return m.eval()


def test_batch_layout(data):
    """Packed examples: prompt, N placeholders per image, answer, end-of-message; labels (shifted) only on the answer
    and the end token; the lengths sum to the stream."""
    examples = data.train_examples(0, 5)
    batch = data.encoder.batch(examples)
    enc = data.encoder
    assert sum(batch.seq_lens) == batch.input_ids.numel() == batch.labels.numel()
    start = 0
    for ex, n, rows in zip(examples, batch.seq_lens, batch.grid_thws.tolist()):
        ids, labels = batch.input_ids[start : start + n].tolist(), batch.labels[start : start + n].tolist()
        start += n
        assert ids[0] == enc.bos and ids[-1] == enc.eos
        assert ids.count(enc.placeholder) == (rows[1] // 2) * (rows[2] // 2)
        answer = data.tokenizer.encode(" " + ex.answer) + [enc.eos]
        assert ids[-len(answer) :] == answer
        # labels[t] = ids[t + 1] exactly where the next token belongs to the answer
        want = [IGNORE_INDEX] * (n - len(answer) - 1) + answer + [IGNORE_INDEX]
        assert labels == want
        assert data.tokenizer.decode(ids[-len(answer) : -1]).strip() == ex.answer


def test_packed_forward_matches_the_padded_reference(data, model):
    """K3ForConditionalGeneration.forward_batch (packed, the training path) gives each example the logits that the
    HF-style forward gives it alone (one image, one placeholder expanded by the model): fp32, 1e-5."""
    examples = data.train_examples(10, 4)
    batch = data.encoder.batch(examples)
    with torch.no_grad():
        packed = model.forward_batch(batch.forward_batch(), batch.pixel_values, batch.grid_thws)
        start = 0
        for k, (ex, n) in enumerate(zip(examples, batch.seq_lens)):
            ids = batch.input_ids[start : start + n]
            ph = data.encoder.placeholder
            one = torch.cat(
                [
                    ids[ids != ph][: (ids == ph).nonzero()[0, 0]],
                    torch.tensor([ph]),
                    ids[(ids == ph).nonzero()[-1, 0] + 1 :],
                ]
            )  # fmt: skip  (one placeholder: expanded)
            pv, grid, _ = data.encoder.images([ex])
            ref = model(one[None], pixel_values=pv, grid_thws=grid).logits[0]
            got = packed[start : start + n]
            assert ref.shape == got.shape
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            start += n


def test_forward_batch_refuses_one_placeholder_for_many_rows(data, model):
    ex = data.train_examples(0, 1)
    pv, grid, rows = data.encoder.images(ex)
    ids = data.encoder.prompt_ids(ex[0], 1)
    assert rows[0] > 1
    with pytest.raises(ValueError, match="N placeholder tokens per image"):
        model.forward_batch(ForwardBatch.from_lengths(torch.tensor(ids), [len(ids)]), pv, grid)


def test_greedy_answers_batched_equal_one_at_a_time(data, model):
    examples = data.heldout()[:5]
    together = greedy_answers(model, data.encoder, examples, max_new_tokens=4)
    alone = [greedy_answers(model, data.encoder, [ex], max_new_tokens=4)[0] for ex in examples]
    assert together == alone


def test_score_per_kind():
    a = vt.VisionExample(vt.blank_like(vt.example(0).image), "q", "Red", "colour")
    b = vt.VisionExample(a.image, "q", "abcd", "text")
    c = vt.VisionExample(a.image, "q", "3", "count")
    out = score([a, b, c], [" red ", "abXd", "3"])
    assert out["vision_exact"] == pytest.approx(2 / 3)
    assert out["vision_exact_colour"] == 1.0 and out["vision_exact_text"] == 0.0 and out["vision_exact_count"] == 1.0
    assert out["vision_cer_text"] == 0.25 and out["vision_cer"] == pytest.approx(0.25 / 3)


def test_heldout_images_are_not_training_images(data):
    """The held-out set is not filtered at run time (the training stream is unbounded); no held-out image equals
    one of the first 5,000 training images (train_examples are the run's stream)."""
    seen = {vt._image_key(ex) for ex in data.train_examples(0, 5000)}
    assert not [ex for ex in data.heldout() if vt._image_key(ex) in seen]


def test_accumulation_gives_the_one_batch_gradient(tmp_path):
    one = Trainer(_cfg(tmp_path / "one", steps=1), log=SILENT)
    acc = Trainer(_cfg(tmp_path / "acc", steps=1, micro_batch_size=2), log=SILENT)
    (r1, g1), (r2, g2) = grads_of_one_step(one), grads_of_one_step(acc)
    assert abs(r1["loss"] - r2["loss"]) <= 1e-5 * abs(r1["loss"])
    assert_gradients_match(g2, g1)
    # The captured gradients are clipped (to norm 1); grad_norm and grad_norm_tower are the norms before it.
    tower = math.sqrt(sum(float(g.double().pow(2).sum()) for n, g in g1.items() if n.startswith("vision_tower.")))
    coef = min(1.0, 1.0 / (r1["grad_norm"] + 1e-6))
    assert r1["grad_norm_tower"] * coef == pytest.approx(tower, rel=1e-5)
    assert 0 < r1["grad_norm_tower"] < r1["grad_norm"]


def _rows(run, name="metrics.jsonl"):
    with open(os.path.join(run, name)) as f:
        return [json.loads(line) for line in f]


def test_resume_is_exact_and_evaluates_with_the_blank_baseline(tmp_path):
    full = Trainer(_cfg(tmp_path / "full", eval_every=2), log=SILENT)
    full.run()
    half = Trainer(_cfg(tmp_path / "half", eval_every=2, stop_after=2), log=SILENT)
    half.run()
    Trainer(_cfg(tmp_path / "half", eval_every=2, resume=True), log=SILENT).run()
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "half")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm_tower"] for r in a] == [r["grad_norm_tower"] for r in b]
    last = a[-1]
    for key in (
        "vision_exact",
        "vision_cer",
        "vision_exact_text",
        "vision_exact_blank",
        "vision_cer_blank",
        "val_loss",
    ):
        assert key in last, key
    assert "vision_exact_blank" not in a[1]  # the blank baseline: final evaluation only
    # `k3 export/serve --ckpt RUN` open a vision run as the multimodal model, with the trained weights
    from openk3.train.checkpoint import latest_checkpoint, load_model

    loaded, _ = load_model(latest_checkpoint(str(tmp_path / "full")))
    assert isinstance(loaded, K3ForConditionalGeneration)
    for (name, p), (_, q) in zip(full.model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name


def test_contrastive_stage_trains_only_the_tower_and_keeps_the_rng(tmp_path):
    """--contrastive-steps: the tower changes, the projector and text model keep their init, the global RNG is
    where a from-scratch run has it (so the runs differ only in the tower), and contrastive.jsonl records it."""
    scratch = Trainer(_cfg(tmp_path / "s", steps=1), log=SILENT)
    clip = Trainer(_cfg(tmp_path / "c", steps=1, contrastive_steps=3), log=SILENT)
    before = {n: p.detach().clone() for n, p in clip.model.named_parameters()}
    from openk3.train.contrastive import pretrain_tower

    rng = torch.get_rng_state()
    pretrain_tower(clip.model, clip.data, clip.cfg, log=SILENT)
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in clip.model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == n.startswith("vision_tower."), n
    rows = _rows(tmp_path / "c", "contrastive.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    for (n, p), (_, q) in zip(scratch.model.named_parameters(), clip.model.named_parameters()):
        if not n.startswith("vision_tower."):
            assert torch.equal(p, q), n  # the same from-scratch init elsewhere


def test_clip_loss_by_hand():
    img = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]), dim=-1)
    txt = torch.nn.functional.normalize(torch.tensor([[1.0, 0.1], [0.0, 1.0], [0.1, 1.0]]), dim=-1)
    scale = torch.tensor(math.log(10.0))
    loss, acc = clip_loss(img, txt, scale, ["a", "b", "b"])  # captions 1 and 2 are equal: shared positives
    logits = 10.0 * img @ txt.T
    targets = torch.tensor([[1.0, 0, 0], [0, 0.5, 0.5], [0, 0.5, 0.5]])
    by_hand = 0.5 * (
        -(targets * logits.log_softmax(1)).sum(1).mean() - (targets * logits.T.log_softmax(1)).sum(1).mean()
    )
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-6)
    assert acc == 1.0  # image 1 picks caption 1 or 2, both "b"


def test_vision_lr_scales_only_the_tower_and_projector(tmp_path):
    """--vision-lr: a first AdamW step moves every parameter with a gradient by its group's lr (|m/sqrt(v)| = 1, no
    weight decay here), so the largest move is lr_at(0) in the text model and lr_at(0) * vision_lr / lr in the tower
    and projector (up to the fp32 rounding of the stored parameters); without the flag there is one lr for all."""
    from openk3.model.hf import VISION_PREFIXES
    from openk3.train.optim import lr_at

    def largest_moves(**kw):
        trainer = Trainer(_cfg(tmp_path / str(len(kw)), steps=1, weight_decay=0.0, **kw), log=SILENT)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train_step()
        moves = {"vision": 0.0, "text": 0.0}
        for n, p in trainer.model.named_parameters():
            if not p.requires_grad:  # the router's correction bias: load balancing's, not the optimizer's
                continue
            part = "vision" if n.startswith(VISION_PREFIXES) else "text"
            moves[part] = max(moves[part], float((p.detach() - before[n]).abs().max()))
        return moves, lr_at(0, trainer.cfg)

    moves, lr0 = largest_moves(lr=1e-3, vision_lr=1e-4)
    assert moves["text"] == pytest.approx(lr0, rel=1e-2)
    assert moves["vision"] == pytest.approx(lr0 / 10, rel=1e-2)
    moves, lr0 = largest_moves(lr=1e-3)
    assert moves["text"] == pytest.approx(lr0, rel=1e-2) and moves["vision"] == pytest.approx(lr0, rel=1e-2)
    # With Muon the tower and projector stay on AdamW (no decoder-layer matrices), in their scaled groups.
    moves, lr0 = largest_moves(lr=1e-3, vision_lr=1e-4, optimizer="muon")
    assert moves["vision"] == pytest.approx(lr0 / 10, rel=1e-2)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"preset": "tiny-vl", "data": "stdlib"}, "--data vision goes with a vision preset"),
        ({"preset": "tiny", "data": "vision"}, "--data vision goes with a vision preset"),
        ({"preset": "tiny-vl", "vision_kinds": "text,maps"}, "--vision-kinds"),
        ({"preset": "tiny-vl", "dp": 2}, "one process"),
        ({"preset": "tiny", "contrastive_steps": 3}, "--contrastive-steps"),
        ({"preset": "tiny-vl", "contrastive_lr": 0.0}, "--contrastive-lr"),
        ({"preset": "tiny-vl", "vision_lr": -1e-4}, "--vision-lr"),
    ],
)
def test_config_errors_name_the_flag(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(out=str(tmp_path), **kw)


def test_vision_preset_defaults_to_vision_data(tmp_path):
    assert TrainConfig(preset="tiny-vl", out=str(tmp_path)).data == "vision"
    assert TrainConfig(preset="tiny", out=str(tmp_path)).data == "stdlib"


def test_encoder_uses_the_release_media_ids():
    config = K3Config.preset("tiny-vl")
    from openk3.data.tokenizer import ByteTokenizer

    t = config.text_config
    enc = VisionEncoder(ByteTokenizer(t.vocab_size, t.bos_token_id, t.eos_token_id, t.pad_token_id), config)
    assert (enc.begin, enc.content, enc.end, enc.placeholder) == (768 + 18, 768 + 19, 768 + 20, 768 + 21)


def test_plot_one_vision_run_and_compare_runs(tmp_path):
    """`k3 plot RUN` of a vision run adds grad_norm.png and vision_eval.png; `k3 plot A B --out D` draws the runs'
    gradient norms on one figure."""
    from openk3.cli import main

    for name, scale in (("a", 1.0), ("b", 3.0)):
        run = tmp_path / name
        run.mkdir()
        rows = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": scale * s, "grad_norm_tower": scale} for s in
                range(1, 5)]  # fmt: skip
        rows[-1].update(val_loss=1.0, vision_exact=0.5, vision_exact_text=0.5, vision_exact_blank=0.0,
                        vision_exact_blank_text=0.0)  # fmt: skip
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", str(tmp_path / "a")]) == 0
    assert {"loss.png", "grad_norm.png", "vision_eval.png"} <= set(os.listdir(tmp_path / "a"))
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]) == 0
    assert os.listdir(tmp_path / "cmp") == ["grad_norm_compare.png"]
