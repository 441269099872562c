"""The RL loop: metrics lines, checkpoints and --resume, plots, and the multi-process update (2 gloo ranks) equal
to the one-process update of the same trajectories, with every rank's engine serving rank 0's weights."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.model.model import K3ForCausalLM
from openk3.rl.config import RLConfig
from openk3.train.optim import param_groups, stable_then_decay
from tests.parallel.dist_helpers import run_ranks

REQUIRED = ("step", "reward", "success", "logprob_gap", "routing_replay", "rollout_tokens_per_s")


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    """A small XTML-speaking policy checkpoint (the training init; a BPE trained on a few task words)."""
    path = str(tmp_path_factory.mktemp("policy"))
    config = K3Config.preset("tiny")
    model = K3ForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(path)
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    train_bpe(["What is 12 times 34, plus 5? print python"] * 10, text.vocab_size, special).save(path)
    return path


def _config(init_dir: str, out: str, **kw) -> RLConfig:
    small = {"task": "calculator", "out": out, "init": init_dir, "groups_per_step": 2, "group_size": 2, "max_turns": 2,
             "max_tokens": 40, "max_tokens_per_turn": 16, "eval_tasks": 2, "eval_every": 2, "save_every": 1,
             "progress": False}  # fmt: skip
    return RLConfig(**{**small, **kw})


def test_run_metrics_resume_and_plot(init_dir, tmp_path, fleet):
    from openk3.rl.loop import RLTrainer
    from openk3.rl.plot import plot_rl_run

    out, lines = str(tmp_path / "run"), []
    # The rate decays over the last step (--lr-decay-steps 1): 1e-3, then 2e-4, resumed in between.
    warm = {"sft_steps": 2, "sft_batch_size": 4, "copy_steps": 2, "sft_guess_share": 0.5, "lr": 1e-3,
            "lr_decay_steps": 1, "lr_min_ratio": 0.2}  # fmt: skip
    trainer = RLTrainer(_config(init_dir, out, steps=2, stop_after=1, **warm), log=lambda *a: None, fleet=fleet)
    trainer.run()
    trainer.close()
    with pytest.raises(FileExistsError, match="--resume"):
        RLTrainer(_config(init_dir, out, steps=2), fleet=fleet)
    trainer = RLTrainer(_config(init_dir, out, steps=2, resume=True, **warm), log=lines.append, fleet=fleet)
    assert trainer.step == 1 and trainer.version == 1 and trainer.sft_done == 2 and trainer.copy_done == 2
    trainer.run()
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([2e-4] * 2)
    trainer.close()
    assert not any("optimizer settings" in line for line in lines)  # a decaying rate's change is no news
    assert any("rate of the next update is 0.0002" in line for line in lines), lines
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]  # the eval line at step 0, then one line per step
    assert [r["lr"] for r in rows[1:]] == pytest.approx([1e-3, 2e-4])
    assert "eval_success" in rows[0] and "eval_success" in rows[2]
    for row in rows[1:]:
        assert all(k in row for k in REQUIRED), sorted(row)
        assert row["routing_replay"] is True and row["logprob_gap"] <= 1e-5
        assert set(row["success"]) == {"calculator"}
    with open(os.path.join(out, "sft.jsonl")) as f:
        warm_rows = [json.loads(line) for line in f]
    # Copy pre-training, then SFT, each done once (the resumed run did not repeat them).
    assert [("copy_step" in r, "sft_step" in r) for r in warm_rows] == [(True, False), (False, True)]
    written = plot_rl_run(out)
    assert {os.path.basename(p) for p in written} == {"reward.png", "logprob_gap.png"}


def test_a_resumed_run_takes_this_runs_learning_rate_not_the_checkpoints(init_dir, tmp_path, fleet):
    """Loading the optimizer's state restores its param groups; the command's --lr and --weight-decay must still
    win (a run resumed at a lower rate would otherwise silently keep the old one), and the change is logged. The
    moments are the checkpoint's all the same."""
    from openk3.rl.loop import RLTrainer

    out = str(tmp_path / "run")
    trainer = RLTrainer(_config(init_dir, out, steps=2, stop_after=1, lr=1e-3), log=lambda *a: None, fleet=fleet)
    trainer.run()
    saved = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    trainer.close()
    lines = []
    trainer = RLTrainer(_config(init_dir, out, steps=2, resume=True, lr=2.5e-4, weight_decay=0.01), log=lines.append,
                        fleet=fleet)  # fmt: skip
    try:
        groups = trainer.optimizer.param_groups
        assert {g["lr"] for g in groups} == {2.5e-4}
        assert sorted(g["weight_decay"] for g in groups) == sorted(g["weight_decay"] for g in
                                                                   param_groups(trainer.model, 0.01))  # fmt: skip
        assert any("lr 0.001 -> 0.00025" in line for line in lines), lines
        state = trainer.optimizer.state_dict()["state"]
        assert saved and all(torch.equal(state[k]["exp_avg"], saved[k]) for k in saved)
    finally:
        trainer.close()
    lines.clear()
    trainer = RLTrainer(_config(init_dir, out, steps=2, resume=True, lr=1e-3), log=lines.append, fleet=fleet)
    trainer.close()
    assert not any("optimizer settings" in line for line in lines)  # the same settings: nothing to say


def test_the_rate_is_stable_then_decays_over_the_last_steps_and_bad_settings_are_named(init_dir):
    """--lr-decay-steps N: --lr, then linear over the last N steps to --lr-min-ratio of it at the last step (a run
    that decays and resumes: test_run_metrics_resume_and_plot)."""
    cfg = _config(init_dir, "unused", steps=10, lr=1e-3, lr_decay_steps=4, lr_min_ratio=0.1)
    rates = [stable_then_decay(s, cfg.lr, cfg.lr * cfg.lr_min_ratio, cfg.steps, cfg.lr_decay_steps) for s in range(10)]
    assert rates == pytest.approx([1e-3] * 6 + [7.75e-4, 5.5e-4, 3.25e-4, 1e-4])
    assert [stable_then_decay(s, 1e-3, 1e-4, 10, 0) for s in range(10)] == [1e-3] * 10  # 0: constant
    for bad in ({"lr_decay_steps": 11}, {"lr_decay_steps": -1}, {"lr_min_ratio": 1.5}):
        with pytest.raises(ValueError, match="--lr-(decay-steps|min-ratio)"):
            _config(init_dir, "unused", steps=10, **bad)


def test_kl_reference_is_the_policy_at_the_start_of_rl_and_resumes(init_dir, tmp_path, fleet):
    """--kl-coef pulls towards the weights RL starts from: after the warm start, not the model before it (the KL at
    step 1, measured on the pre-update weights, is then 0); the reference is saved with the run and is the start's
    weights in the file and in the resumed trainer, and two steps with a stop between equal two in one go, bit for
    bit (KL and weights)."""
    from openk3.rl.loop import REFERENCE, RLTrainer
    from openk3.train.checkpoint import load_model

    warm = {"sft_steps": 2, "sft_batch_size": 4, "sft_guess_share": 0.5, "kl_coef": 0.5, "eval_every": 100}
    runs = {}
    for name, parts in (("whole", [{}]), ("split", [{"stop_after": 1}, {"resume": True}])):
        out = str(tmp_path / name)
        for kw in parts:
            trainer = RLTrainer(_config(init_dir, out, steps=2, **warm, **kw), log=lambda *a: None, fleet=fleet)
            if trainer.step == 0:
                trainer.warm_start()
                start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
            trainer.run()
            trainer.close()
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if "kl" in line]
        runs[name] = (rows, trainer.model.state_dict(), start)
        reference, _ = load_model(os.path.join(out, REFERENCE), dtype=torch.float32)
        assert all(torch.equal(v, start[k]) for k, v in reference.state_dict().items())
        assert all(torch.equal(v, start[k]) for k, v in trainer.reference.state_dict().items())
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-7)
    fresh = K3ForCausalLM.from_pretrained(init_dir).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in fresh.items())  # the warm start moved the weights
    (whole_rows, whole_w, _), (split_rows, split_w, _) = runs["whole"], runs["split"]
    assert [r["kl"] for r in whole_rows] == [r["kl"] for r in split_rows]
    assert all(torch.equal(v, split_w[k]) for k, v in whole_w.items())


@pytest.mark.parametrize("replay", [True, False])
def test_micro_batched_update_is_the_one_forward_update(init_dir, tmp_path, fleet, replay):
    """The update in micro-batches of a few trajectories accumulates the gradient of one forward over all of them
    (the same trajectories, the same starting weights), and reports the same metrics."""
    from openk3.rl.loop import RLTrainer

    kw = {"groups_per_step": 2, "group_size": 3, "routing_replay": replay}
    whole = RLTrainer(_config(init_dir, str(tmp_path / "whole"), micro_batch_tokens=10**6, **kw), log=lambda *a: None,
                      fleet=fleet)  # fmt: skip
    trajs = whole._new_trajectories()
    whole.worker.run(trajs, whole.version)
    # Rewards of a random policy are all 0; give the groups a spread so the advantages (and gradients) are not 0.
    for i, t in enumerate(trajs):
        t.reward = float(i % 2)
    micro = RLTrainer(_config(init_dir, str(tmp_path / "micro"), micro_batch_tokens=1, **kw), log=lambda *a: None,
                      fleet=fleet)  # fmt: skip
    m_whole, m_micro = whole.update(trajs), micro.update(trajs)
    assert m_whole["micro_batches"] == 1 and m_micro["micro_batches"] == len(trajs)
    for key in ("loss", "ratio_mean", "clip_fraction", "grad_norm"):
        assert m_micro[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-9), key
    for key in ("logprob_gap_replay", "logprob_gap_natural"):  # rounding-level values; the packing changes rounding
        assert m_micro[key] == pytest.approx(m_whole[key], abs=1e-6), key
    assert m_whole["grad_norm"] > 0
    grads = dict(micro.model.named_parameters())
    for name, p in whole.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    whole.worker.close(trajs)
    whole.close()
    micro.close()


def test_gap_the_other_way_is_measured_every_gap_check_every_steps(init_dir, tmp_path, fleet):
    """The extra forward for the other gap runs on step 1 and every N steps after (None between); 0 never."""
    from openk3.rl.loop import RLTrainer

    for every, measured in ((3, [True, False, False, True]), (0, [False, False])):
        trainer = RLTrainer(_config(init_dir, str(tmp_path / f"every{every}"), gap_check_every=every),
                            log=lambda *a: None, fleet=fleet)  # fmt: skip
        trajs = trainer._new_trajectories()
        trainer.worker.run(trajs, trainer.version)
        for step, expect in enumerate(measured):
            trainer.step = step  # the update of step `step + 1`
            row = trainer.update(trajs)
            assert row["logprob_gap_replay"] == row["logprob_gap"]  # the gap it trains with, every step
            assert (row["logprob_gap_natural"] is not None) == expect, (every, step)
        trainer.worker.close(trajs)
        trainer.close()
    with pytest.raises(ValueError, match="gap-check-every"):
        _config(init_dir, str(tmp_path / "bad"), gap_check_every=-1)


class _NoFleet:
    """The ranks of the layout tests train on injected trajectories: they start no sandbox."""

    def close(self) -> None: ...


def _updates(trainer, trajs, steps: int) -> list[dict]:
    rows = []
    for _ in range(steps):
        rows.append(trainer.update(trajs))
        trainer.step += 1
        trainer.version += 1
    return rows


def _layout_rank(rank: int, world: int, init_dir: str, out: str, layout: dict, trajs, steps: int):
    from openk3.rl.loop import RLTrainer

    trainer = RLTrainer(_config(init_dir, out, **layout), log=lambda *a: None, fleet=_NoFleet())
    rows = _updates(trainer, trajs, steps)
    weights = {name: t.clone() for name, t in trainer.sync.full_tensors(trainer.model)}
    trainer._publish(force=True)  # every rank's engine gets the sharded policy, gathered tensor by tensor
    engine = {k: v.clone() for k, v in trainer.engine.model.state_dict().items()}
    path = trainer.save()
    trainer.close()
    return {"rows": rows, "weights": weights if rank == 0 else None, "engine_equal": all(
        torch.equal(engine[k], w) for k, w in weights.items()), "checkpoint": path}  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("world, layout", [(2, {"dp": 2}), (2, {"ep": 2}), (4, {"dp": 2, "ep": 2, "kl_coef": 0.1}),
                                           (2, {"cp": 2, "kl_coef": 0.1})],
                         ids=["dp2", "ep2", "dp2-ep2-kl", "cp2-kl"])  # fmt: skip
def test_sharded_updates_equal_one_process(init_dir, tmp_path, fleet, world, layout):
    """The same trajectories (rolled out once, injected), 3 updates: every layout trains the policy sharded exactly
    as k3 train does and equals one process (losses and weights within 1e-5 relative); the routing-replay log-prob
    gap stays at rounding level under EP; every rank's engine receives the gathered policy; and the checkpoint,
    saved shard by shard, resumes in one process with the same weights."""
    from openk3.rl.loop import RLTrainer

    extra = {k: v for k, v in layout.items() if k == "kl_coef"}
    single = RLTrainer(_config(init_dir, str(tmp_path / "one"), groups_per_step=2, group_size=3, **extra),
                       log=lambda *a: None, fleet=fleet)  # fmt: skip
    trajs = single._new_trajectories()
    single.worker.run(trajs, single.version)
    for i, t in enumerate(trajs):  # a spread of rewards, so the advantages (and gradients) are not 0
        t.reward = float(i % 2)
    sendable = [dataclasses.replace(t, env=None) for t in trajs]
    ranks = run_ranks(world, _layout_rank, init_dir, str(tmp_path / "laid-out"), {**layout, "groups_per_step": 2,
                      "group_size": 3}, sendable, 3)  # fmt: skip
    want = _updates(single, trajs, 3)
    single.worker.close(trajs)
    got = ranks[0]["rows"]
    for step, (g, w) in enumerate(zip(got, want)):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-8), step
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5), step
        assert g["trained_sequences"] == w["trained_sequences"] == 6
    assert got[0]["logprob_gap_max"] <= 1e-5  # routing replay: the trainer scores what the engine sampled
    assert all(r["engine_equal"] for r in ranks)
    weights, want_w = ranks[0]["weights"], single.model.state_dict()
    # The whole policy within 1e-5 relative; a tensor alone within 1e-4: AdamW divides by sqrt(v), so a parameter
    # whose gradient is near zero (AttnRes pseudo-queries start at 0) turns the summation order's rounding into a
    # larger relative change of its (tiny) weights.
    diff = sum(float((weights[k] - t).double().square().sum()) for k, t in want_w.items()) ** 0.5
    norm = sum(float(t.double().square().sum()) for t in want_w.values()) ** 0.5
    worst = max((_rel(weights[k], t), k) for k, t in want_w.items())
    assert diff / norm <= 1e-5 and worst[0] <= 1e-4, (diff / norm, worst)
    single.close()
    resumed = RLTrainer(_config(init_dir, str(tmp_path / "laid-out"), resume=True), log=lambda *a: None, fleet=fleet)
    try:
        assert resumed.step == 3 and resumed.version == 3
        assert all(torch.equal(t, weights[name]) for name, t in resumed.model.state_dict().items())
    finally:
        resumed.close()


def test_a_warm_start_stopped_by_a_signal_resumes_inside_its_phase(init_dir, tmp_path, fleet):
    """Ctrl-C during copy pre-training: the run saves at the end of that step and says how to continue; --resume
    continues the copy phase where it stopped (no step repeated) and the warm start ends with the weights of one
    that was never stopped, bit for bit (optimizer moments, streams and RNG are in the checkpoint)."""
    import signal

    from openk3.rl.loop import RLTrainer

    warm = {"copy_steps": 4, "sft_steps": 2, "sft_batch_size": 4, "steps": 1, "eval_every": 100}
    whole = RLTrainer(_config(init_dir, str(tmp_path / "whole"), **warm), log=lambda *a: None, fleet=fleet)
    whole.warm_start()
    want = {k: v.clone() for k, v in whole.model.state_dict().items()}
    whole.close()

    out, lines = str(tmp_path / "split"), []
    trainer = RLTrainer(_config(init_dir, out, **warm), log=lines.append, fleet=fleet)
    batch, calls = trainer.copies.batch, []

    def interrupted(n):  # the second copy step's batch: a Ctrl-C arrives while it trains
        calls.append(n)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return batch(n)

    trainer.copies.batch = interrupted
    assert trainer.run() == {}
    trainer.close()
    assert trainer.stopped_by == signal.SIGINT and trainer.copy_done == 2 and trainer.sft_done == 0
    assert any("continue with: k3 rl --out" in line and "--resume" in line for line in lines), lines
    assert not os.path.exists(os.path.join(out, "metrics.jsonl"))  # RL never started
    resumed = RLTrainer(_config(init_dir, out, resume=True, **warm), log=lambda *a: None, fleet=fleet)
    try:
        assert (resumed.copy_done, resumed.sft_done, resumed.step) == (2, 0, 0)
        resumed.warm_start()
        assert (resumed.copy_done, resumed.sft_done) == (4, 2)
        got = resumed.model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items())
    finally:
        resumed.close()
    with open(os.path.join(out, "sft.jsonl")) as f:
        assert [json.loads(line).get("copy_step") for line in f] == [4, None]  # each phase's last line, once


@pytest.mark.slow
def test_a_four_rank_run_finishes_under_the_watchdog_and_resumes_in_one_process(init_dir, tmp_path):
    """`k3 rl --nproc 4 --dp 2 --ep 2`, 10 steps, through the command line (torchrun, gloo, each rank its own engine
    and sandboxes), with a 120 s collective timeout: it finishes (no rank waits for a collective another never
    makes; the steps cross two evaluations and two saves, where the ranks' work differs most), and `--resume`
    continues it in one process from its sharded checkpoint."""
    import subprocess
    import sys

    out = str(tmp_path / "run")
    flags = ["--task", "calculator", "--init", init_dir, "--out", out, "--groups-per-step", "4", "--group-size", "2",
             "--max-turns", "2", "--max-tokens", "24", "--max-tokens-per-turn", "12", "--eval-tasks", "2",
             "--eval-every", "5", "--save-every", "5", "--no-progress", "--threads", "1"]  # fmt: skip
    env = {**os.environ, "OPENK3_COLLECTIVE_TIMEOUT_S": "120"}
    run = [sys.executable, "-m", "openk3.cli", "rl", *flags]
    done = subprocess.run([*run, "--steps", "10", "--nproc", "4", "--dp", "2", "--ep", "2"], env=env, timeout=900,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(11))
    assert all(r["logprob_gap"] <= 1e-5 for r in rows[1:] if r.get("trained_sequences"))
    resumed = subprocess.run([*run, "--steps", "11", "--resume"], env=env, timeout=600, capture_output=True, text=True,
                             check=False)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(12))


def test_bad_layouts_and_resumes_are_named_before_any_work_and_runs_export(init_dir, tmp_path, fleet):
    """An EP degree that does not divide the experts, a layout larger than the world, and a --resume whose model
    differs from the command's are named errors raised before anything in --out is written; a resumed run tolerates
    a metrics line a kill cut short (and rewrites the file whole); `k3 export` turns an RL run into a release
    folder."""
    from openk3.cli import main
    from openk3.rl.loop import RLTrainer

    experts = K3Config.preset("tiny").text_config.num_experts
    for bad, match in (({"ep": experts + 1}, f"--ep {experts + 1} must divide"),
                       ({"cp": 2}, "--cp 2 must equal the world size 1")):  # fmt: skip
        out = tmp_path / f"bad-{next(iter(bad))}"
        with pytest.raises(ValueError, match=match):
            RLTrainer(_config(init_dir, str(out), **bad), log=lambda *a: None, fleet=fleet)
        assert not out.exists()
    out = str(tmp_path / "run")
    trainer = RLTrainer(_config(init_dir, out, steps=1), log=lambda *a: None, fleet=fleet)
    trainer.run()
    trainer.close()
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 2, "reward": 0.')  # a kill in the middle of a line
    other = tmp_path / "other-init"
    tiny = K3Config.preset("tiny")
    model = K3ForCausalLM(dataclasses.replace(tiny, text_config=dataclasses.replace(tiny.text_config,
                                                                                     num_experts=2 * experts)))  # fmt: skip
    model.init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(str(other))
    listing = sorted(os.listdir(out))
    with pytest.raises(ValueError, match="holds another model than --init .*num_experts"):
        RLTrainer(_config(str(other), out, steps=2, resume=True), log=lambda *a: None, fleet=fleet)
    assert sorted(os.listdir(out)) == listing
    resumed = RLTrainer(_config(init_dir, out, steps=2, resume=True), log=lambda *a: None, fleet=fleet)
    resumed.run()
    resumed.close()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1, 2]
    assert main(["export", "--ckpt", out, "--out", str(tmp_path / "release")]) == 0
    exported = K3ForCausalLM.from_pretrained(str(tmp_path / "release")).state_dict()  # the release's dtypes (bf16)
    assert all(torch.equal(exported[k], v.to(exported[k].dtype)) for k, v in resumed.model.state_dict().items())
