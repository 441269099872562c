"""Multi-teacher on-policy distillation (`k3 distill`, rl/distill.py): the Eq. 15 reward (exactly 0 for a teacher with
the student's weights, partial rollouts included; clipped; no gradient into the teacher or through the stop-gradient),
the right teacher for every token of a batch mixing domains and efforts, the effort budget and its τ schedule, exact
resume, the baselines (top-k target, off-policy SFT, RL), and the named errors of the teacher registry."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer, train_bpe
from openk3.model.model import K3ForCausalLM
from openk3.rl.distill import DistillTrainer, budget_reward, loss_groups, offpolicy_weights, opd_reward
from openk3.rl.distill_config import DistillConfig, TauSchedule, parse_tau_final
from openk3.rl.envs import initial_messages
from openk3.rl.evaluate import evaluate_policy, policy_episodes
from openk3.rl.logprobs import sequence_log_softmax, sequence_logprobs
from openk3.rl.teachers import TeacherKey, TeacherRegistry, VocabularyMismatch, parse_teachers
from openk3.rl.transcript import prompt_ids
from openk3.train.batch import TokenBatch, micro_batches
from openk3.train.checkpoint import load_model
from openk3.train.losses import LossConfig, Normalizers, Scores, get_loss
from tests.train.train_helpers import capture_grads

WORDS = "What is 12 times 34, plus 5? print python cat grep ls value of port in conf main.ini How many lines ERROR"


def _save(model, tokenizer, path) -> str:
    model.save_pretrained(path)
    tokenizer.save(path)
    return str(path)


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """The student's init and two teachers (the init with seeded noise on every weight), one tokenizer."""
    root = tmp_path_factory.mktemp("distill")
    config = K3Config.preset("tiny")
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    tokenizer = train_bpe([WORDS] * 10, text.vocab_size, special)
    model = K3ForCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(0))
    paths = {"init": _save(model, tokenizer, root / "init")}
    for name, seed in (("a", 1), ("b", 2)):
        other = K3ForCausalLM(config)
        other.load_state_dict(model.state_dict())
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g) * p.abs().mean().clamp(min=1e-3))
        paths[name] = _save(other, tokenizer, root / name)
    return paths


def _config(policies, out, teachers: str, **kw) -> DistillConfig:
    small = {"teachers": teachers, "out": str(out), "init": policies["init"], "groups_per_step": 2, "group_size": 2,
             "max_turns": 2, "max_tokens": 24, "max_tokens_per_turn": 12, "eval_tasks": 2, "eval_every": 2,
             "save_every": 1, "progress": False, "lr": 1e-3}  # fmt: skip
    return DistillConfig(**{**small, **kw})


def _trainer(cfg, fleet) -> DistillTrainer:
    return DistillTrainer(cfg, log=lambda *a, **k: None, fleet=fleet)


# ---- the reward ------------------------------------------------------------------------------------------------
def test_opd_reward_is_the_clipped_log_ratio_without_gradient():
    teacher = torch.tensor([-0.5, -9.0, -0.1, -20.0, -1.0], requires_grad=True)
    student = torch.tensor([-1.0, -0.5, -8.0, -1.0, -1.0], requires_grad=True)
    r = opd_reward(teacher, student, r_max=5.0)
    assert not r.requires_grad  # the stop-gradient: nothing flows back into either side
    assert r.tolist() == [0.5, -5.0, 5.0, -5.0, 0.0]  # clipped exactly at ±R_max, exact inside
    assert opd_reward(teacher, student, r_max=100.0).tolist() == pytest.approx([0.5, -8.5, 7.9, -19.0, 0.0])
    with pytest.raises(ValueError, match="r_max"):
        opd_reward(teacher, student, r_max=0.0)


def test_reward_is_exactly_zero_for_a_teacher_with_the_students_weights(policies, fleet, tmp_path):
    """Teacher = the student's init, partial rollouts (λ = 0.5, one step of staleness): every token's reward is exactly
    0 in every step (so the update is zero and the weights stay the teacher's), continued trajectories included."""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['init']}", steps=3,
                  partial_rollout_fraction=0.5, max_off_policy_steps=1, max_tokens=24, max_tokens_per_turn=8)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    seen, segments = [], []
    score = trainer.opd_scores  # what the update's `opd` loss turns into the reward

    def spy(trajs):
        teacher_lps, student_lps = score(trajs)
        seen.extend(opd_reward(t, lp, cfg.r_max) for t, lp in zip(teacher_lps, student_lps))
        segments.extend(len(t.segments()) for t in trajs)
        return teacher_lps, student_lps

    trainer.opd_scores = spy
    try:
        for _ in range(3):
            trainer.train_step()
    finally:
        trainer.close()
    assert seen and all(torch.count_nonzero(r) == 0 for r in seen)
    assert max(segments) > 1, "no trajectory was continued across steps"
    init, _ = load_model(policies["init"], dtype=torch.float32)
    for (name, p), q in zip(trainer.model.named_parameters(), init.parameters()):
        assert torch.equal(p, q), name


def test_no_gradient_reaches_the_teacher_or_passes_the_stop_gradient(policies, fleet, tmp_path):
    """The update's gradient is the REINFORCE gradient with the rewards as constants, and the teacher gets none."""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']}", loss="reinforce", correction="none",
                  grad_clip=1e9, routing_replay=False)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    try:
        trajs = trainer._new_trajectories()
        trainer.worker.run(trajs, trainer.version)
        rewards, _ = trainer.opd_rewards(trajs)
        got = capture_grads(trainer)  # the gradients the optimizer step applies
        trainer.update(trajs)
        with trainer.teachers.use(TeacherKey("calculator")) as teacher:
            assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
        # The same gradient by hand from the weights before the step: -sum(r_t * logp_t) / N over generated tokens.
        reference, _ = load_model(policies["init"], dtype=torch.float32)  # the student before the step
        logps = sequence_logprobs(reference, [t.tokens for t in trajs])
        masks = [torch.tensor(t.generated[1:]) for t in trajs]
        n = sum(int(m.sum()) for m in masks)
        loss = -sum((r * lp * m).sum() for r, lp, m in zip(rewards, logps, masks)) / n
        loss.backward()
    finally:
        trainer.close()
    want = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_each_token_is_scored_by_the_teacher_of_its_domain_and_effort(policies, fleet, tmp_path):
    """A batch of calculator, files:low and files:max episodes, three different teachers: every trajectory's teacher
    log-probs equal its own teacher's, computed alone on the episode behind the teacher's (untagged) prompt, and
    differ from the other teachers'; the student side is scored with the effort tag."""
    specs = {"calculator": policies["a"], "files:low": policies["b"], "files:max": policies["init"]}
    cfg = _config(policies, tmp_path / "run", ",".join(f"{k}={v}" for k, v in specs.items()), groups_per_step=3,
                  budget_weight=0.0)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    try:
        assert trainer.eval_episodes == 3 * cfg.eval_tasks  # the engine and fleet are sized per key, not per domain
        trajs = trainer._new_trajectories()
        assert sorted({str(trainer.key_of(t)) for t in trajs}) == sorted(specs)
        trainer.worker.run(trajs, trainer.version)
        rewards, teacher_lps = trainer.opd_rewards(trajs)
        student = trainer.model
    finally:
        trainer.close()
    models = {name: load_model(path, dtype=torch.float32)[0] for name, path in specs.items()}
    for traj, reward, got in zip(trajs, rewards, teacher_lps):
        key = str(trainer.key_of(traj))
        if key != "calculator":
            assert "thinking_effort=" + traj.effort in trainer.tokenizer.decode(traj.tokens[: traj.prompt_len])
        prompt = prompt_ids(initial_messages(traj.task), traj.task.tools, trainer.tokenizer, thinking=traj.thinking)
        assert "thinking_effort" not in trainer.tokenizer.decode(prompt)
        context = prompt + traj.tokens[traj.prompt_len :]
        start = traj.prompt_len - 1
        with torch.no_grad():
            scores = {name: sequence_logprobs(m, [context])[0][len(prompt) - 1 :] for name, m in models.items()}
            mine = sequence_logprobs(student, [traj.tokens])[0][start:]
        torch.testing.assert_close(got[start:], scores[key], rtol=0, atol=1e-5)
        assert (got[:start] == 0).all() and (reward[:start] == 0).all()
        torch.testing.assert_close(reward[start:], (scores[key] - mine).clamp(-5, 5), rtol=0, atol=2e-5)
        for other, s in scores.items():
            if other != key:
                assert (got[start:] - s).abs().max() > 1e-3, (key, other)


def test_teacher_temperature_sharpens_every_teacher_target(policies, fleet, tmp_path):
    """--teacher-temperature 0.5 with the student's own weights as teacher: the opd scores and the top-k target are
    the teacher's softmax(logits / 0.5) (so the reward is no longer 0), and the off-policy samples are drawn at 0.5."""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['init']}", teacher_temperature=0.5,
                  budget_weight=0.0)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    drawn = []
    try:
        trajs = trainer._new_trajectories()
        trainer.worker.run(trajs, trainer.version)
        rewards, teacher_lps = trainer.opd_rewards(trajs)
        targets = trainer._teacher_topk(trajs)
        worker = trainer._teacher_worker(trainer.key_of(trajs[0]))
        run = worker.run
        worker.run = lambda samples, version, **kw: drawn.append(kw) or run(samples, version, **kw)
        trainer._offpolicy_step()
    finally:
        trainer.close()
    assert drawn == [{"temperature": 0.5}]
    teacher = load_model(policies["init"], dtype=torch.float32)[0]
    for traj, reward, got, (ids, q) in zip(trajs, rewards, teacher_lps, targets):
        start = traj.prompt_len - 1
        with torch.no_grad():
            sharp = sequence_logprobs(teacher, [traj.tokens], temperature=0.5)[0][start:]
            plain = sequence_logprobs(teacher, [traj.tokens])[0][start:]
            rows = sequence_log_softmax(teacher, [traj.tokens], temperature=0.5)[0][start:]
        torch.testing.assert_close(got[start:], sharp, rtol=0, atol=1e-5)
        torch.testing.assert_close(reward[start:], (sharp - plain).clamp(-5, 5), rtol=0, atol=2e-5)
        assert reward[start:].abs().max() > 1e-3
        top, top_ids = rows.topk(cfg.topk, dim=-1)
        assert torch.equal(ids[start:], top_ids)
        torch.testing.assert_close(q[start:], torch.softmax(top, dim=-1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="teacher-temperature"):
        _config(policies, tmp_path / "bad", f"calculator={policies['init']}", teacher_temperature=0.0).validate()


# ---- the effort budget -----------------------------------------------------------------------------------------
def test_budget_reward_is_minus_one_exactly_above_tau_b0():
    assert budget_reward(30, b0=20, tau=1.5) == 0.0  # at the budget
    assert budget_reward(31, b0=20, tau=1.5) == -1.0
    assert budget_reward(5, b0=20, tau=0.25) == 0.0
    assert budget_reward(6, b0=20, tau=0.25) == -1.0


def test_tau_anneals_linearly_to_each_efforts_final_value():
    tau = TauSchedule(start=3.0, final=parse_tau_final("low=0.5,max=1.5"), anneal_steps=10)
    assert tau("low", 0) == 3.0 and tau("max", 0) == 3.0
    assert tau("low", 5) == pytest.approx(1.75) and tau("max", 5) == pytest.approx(2.25)
    assert tau("low", 10) == 0.5 and tau("low", 99) == 0.5 and tau("max", 10) == 1.5
    assert TauSchedule(2.0, {"low": 0.5}, 0)("low", 0) == 0.5  # no annealing: the final value from the start
    with pytest.raises(KeyError, match="high"):
        tau("high", 3)
    for bad in ("low=x", "tiny=0.5", "low=-1", "low"):
        with pytest.raises(ValueError, match="--tau-final"):
            parse_tau_final(bad)


def test_budget_uses_the_cold_starts_b0_and_the_schedule(policies, fleet, tmp_path):
    """b0 is measured once per effort-tagged task with the cold start (greedy, at the domain's highest effort); an
    episode gets −1 exactly when it is longer than τ(step)·b0; calculator (no effort) has no budget."""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']},files:low={policies['b']},"
                  f"files:max={policies['a']}", groups_per_step=3, tau_start=2.0, tau_final="low=0.5,max=1.0",
                  tau_anneal_steps=4, max_tokens=40)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    try:
        trajs = trainer._new_trajectories()
        tagged = {t.task.task_id for t in trajs if t.effort}
        assert set(trainer.b0) == tagged and all(b >= 1 for b in trainer.b0.values())
        # b0 is the cold start's greedy length at max effort: measure one again by hand.
        task = next(t.task for t in trajs if t.effort == "low")
        probe = trainer._cold().start(task, group=-2, effort="max")
        trainer._cold().run([probe], version=0, temperature=0.0)
        assert trainer.b0[task.task_id] == max(probe.num_generated, 1)
        trainer.worker.run(trajs, trainer.version)
        for traj in trajs:
            b0 = trainer.b0.get(traj.task.task_id)
            for step in (0, 2, 4, 9):
                got = trainer.budget(traj, step)
                if traj.effort is None:
                    assert got == 0.0
                else:
                    limit = cfg.tau(traj.effort, step) * b0
                    assert got == (-1.0 if traj.num_generated > limit else 0.0)
    finally:
        trainer.close()


# ---- runs ------------------------------------------------------------------------------------------------------
def test_resume_of_a_distillation_run_is_exact(policies, fleet, tmp_path):
    """Two steps in one go ≡ one step, a stop, and a resume: the weights bit for bit and every step's metrics (the
    stop's extra evaluation at step 1 draws no sampling seed a later step uses)."""
    teachers = f"calculator:low={policies['a']}"  # an effort key: b0 is measured, saved and restored
    small = {"steps": 2, "eval_tasks": 1, "eval_every": 5, "max_tokens": 16, "max_tokens_per_turn": 8}
    runs = {}
    for name, kw in (("whole", {}), ("part", {"stop_after": 1}), ("part", {"resume": True})):
        trainer = _trainer(_config(policies, tmp_path / name, teachers, **small, **kw), fleet)
        try:
            if kw.get("resume"):
                assert trainer.step == 1 and trainer.b0 == runs["part"].b0 and trainer.b0
            trainer.run()
        finally:
            trainer.close()
        runs[name] = trainer
    for (name, p), q in zip(runs["whole"].model.named_parameters(), runs["part"].model.parameters()):
        assert torch.equal(p, q), name
    rows = {}
    for name in ("whole", "part"):
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows[name] = {r["step"]: r for r in map(json.loads, f)}
    assert sorted(rows["part"]) == [0, 1, 2]
    for step in (1, 2):
        for key in ("reward", "opd_reward", "response_tokens", "budget_penalty_rate", "loss"):
            assert rows["whole"][step][key] == rows["part"][step][key], (step, key)
    assert rows["whole"][2]["eval_success"] == rows["part"][2]["eval_success"]
    assert os.path.exists(tmp_path / "part" / "distill_config.json")


def test_topk_target_is_zero_for_the_students_own_distribution(policies, fleet, tmp_path):
    """With k = the whole vocabulary and the teacher = the student, the forward KL is 0: the teacher's rows are
    aligned with the student's positions; with a small k it is the log of the top-k mass, positive."""
    vocab = K3Config.preset("tiny").text_config.vocab_size
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['init']}", method="topk", topk=vocab)
    trainer = _trainer(cfg, fleet)
    try:
        trajs = trainer._new_trajectories()
        trainer.worker.run(trajs, trainer.version)
        assert abs(trainer.update(trajs)["forward_kl_topk"]) < 1e-5
        trainer.cfg.topk = 4  # the student has moved one step away from the teacher since: KL >= log(1 / top-4 mass)
        assert trainer.update(trajs)["forward_kl_topk"] > 1e-3
    finally:
        trainer.close()


@pytest.mark.parametrize("method", ["rl", "offpolicy"])
def test_baseline_methods_run_a_step(policies, fleet, tmp_path, method):
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']},files:max={policies['b']}", method=method,
                  steps=1)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    try:
        row = trainer.train_step()
    finally:
        trainer.close()
    assert row["step"] == 1 and row["trained_sequences"] == 4
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert "opd_reward" not in row  # neither scores tokens with a teacher


def test_offpolicy_keep_solved_trains_only_on_the_teacher_samples_that_solve_their_task(policies, fleet, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    """Rejection sampling (--offpolicy-keep solved): of a step's teacher samples only the solved ones reach the SFT
    loss, each whole behind the student's tagged prompt; a step that keeps none leaves the student as it was."""
    from openk3.train.batch import TokenBatch

    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']},files:max={policies['b']}",
                  method="offpolicy", offpolicy_keep="solved", steps=2)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    trained, solved = [], []
    real_pack = TokenBatch.from_sequences

    def spy(sequences, masks, **kw):  # what the update packs is what it trains on
        trained.extend(zip(sequences, masks))
        return real_pack(sequences, masks, **kw)

    monkeypatch.setattr(TokenBatch, "from_sequences", staticmethod(spy))
    verdict = {"solve": lambda sample: sample.sample == 0}  # which samples the test declares solved

    def judged(run):
        def run_and_judge(samples, version, **kw):
            run(samples, version, **kw)
            for sample in samples:
                sample.reward = 1.0 if verdict["solve"](sample) else 0.0
                if sample.reward:
                    solved.append(sample.tokens[sample.prompt_len :])

        return run_and_judge

    try:
        for key in trainer.keys:
            worker = trainer._teacher_worker(key)
            worker.run = judged(worker.run)
        row = trainer.train_step()
        verdict["solve"] = lambda sample: False
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        empty = trainer.train_step()
        after = trainer.model.state_dict()
    finally:
        trainer.close()
    assert row["trained_sequences"] == 2 and row["kept_fraction"] == 0.5 and row["reward"] == 0.5
    assert len(trained) == len(solved) == 2

    def is_trained(episode):  # some trained sample ends with the episode and masks everything before it
        return any(tokens[len(tokens) - len(episode) :] == episode and any(mask) and not any(mask[: len(tokens)
                   - len(episode)]) for tokens, mask in trained)  # fmt: skip

    assert all(is_trained(episode) for episode in solved)
    assert empty["trained_sequences"] == 0 and empty["kept_fraction"] == 0.0 and empty["step"] == 2
    assert all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="--offpolicy-keep"):
        _config(policies, tmp_path / "bad", f"calculator={policies['a']}", offpolicy_keep="solved")


def test_offpolicy_draws_keeps_the_first_group_size_solved_of_n_teacher_samples(policies, fleet, tmp_path):
    """--offpolicy-draws calculator=4: the calculator teacher samples 4 episodes of each task and the first 2
    (--group-size) that solve it are kept; the other keys draw --group-size. Bad specs are named."""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']},files:max={policies['b']}",
                  method="offpolicy", offpolicy_keep="solved", offpolicy_draws="calculator=4", steps=1)  # fmt: skip
    assert cfg.draws == {"calculator": 4, "files:max": 2}
    trainer = _trainer(cfg, fleet)
    drawn = {}

    def judged(key, run):
        def run_and_judge(samples, version, **kw):
            run(samples, version, **kw)
            drawn[str(key)] = sorted(sample.sample for sample in samples)
            for sample in samples:  # samples 1, 2, 3 solve: calculator keeps 1 and 2, files:max 1
                sample.reward = 1.0 if sample.sample >= 1 else 0.0

        return run_and_judge

    try:
        for key in trainer.keys:
            worker = trainer._teacher_worker(key)
            worker.run = judged(key, worker.run)
        row = trainer.train_step()
    finally:
        trainer.close()
    assert drawn == {"calculator": [0, 1, 2, 3], "files:max": [0, 1]}
    assert row["trained_by_key"] == {"calculator": 2, "files:max": 1}
    assert row["covered_by_key"] == {"calculator": 1.0, "files:max": 1.0}
    assert row["reward"] == pytest.approx(4 / 6)  # over every sample drawn
    teachers = f"calculator={policies['a']},files:max={policies['b']}"
    assert _config(policies, tmp_path / "x", teachers, method="offpolicy", offpolicy_keep="solved",
                   offpolicy_draws="3").draws == {"calculator": 3, "files:max": 3}  # fmt: skip
    for bad, match in (({"offpolicy_draws": "code-fix=4"}, "not key=N"), ({"offpolicy_draws": "calculator=x"},
                       "not a whole number"), ({"offpolicy_draws": "1"}, ">= --group-size"),
                       ({"offpolicy_draws": "4", "offpolicy_keep": "all"}, "--offpolicy-keep solved")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _config(policies, tmp_path / "bad", teachers, **{"method": "offpolicy", "offpolicy_keep": "solved", **bad})


def test_offpolicy_draws_beyond_the_group_size_fit_the_trainers_own_fleet(policies, fleet, tmp_path):
    """Best of 12 for 2 tasks of one key: the step has 24 episodes in flight, more than --groups x --group-size
    (2) and the evaluation (1) would size the trainer's own sandbox fleet and the teacher's engine for; all 24 run.
    (`fleet` only skips the test where sandboxes are unavailable: the trainer makes its own here.)"""
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']}", method="offpolicy", groups_per_step=2,
                  group_size=1, eval_tasks=1, offpolicy_keep="solved", offpolicy_draws="12", steps=1)  # fmt: skip
    trainer = DistillTrainer(cfg, log=lambda *a, **k: None)
    drawn = []
    try:
        assert trainer.step_episodes == 24 and trainer.fleet.max_sandboxes >= 24
        worker = trainer._teacher_worker(trainer.keys[0])
        run = worker.run

        def counted(samples, version, **kw):
            drawn.extend(samples)
            return run(samples, version, **kw)

        worker.run = counted
        row = trainer.train_step()
    finally:
        trainer.close()
    assert len(drawn) == 24 and all(sample.done for sample in drawn)
    assert row["step"] == 1 and sorted({sample.group for sample in drawn}) == [0, 1]


def test_offpolicy_loss_groups_weigh_every_token_or_every_key():
    keys = ["files:max", "calculator", "files:max", "code-fix", "calculator"]
    assert loss_groups(keys, "tokens") == [[0, 1, 2, 3, 4]]
    assert loss_groups(keys, "keys") == [[1, 4], [3], [0, 2]]  # keys in order; a key absent from the step is no group
    assert loss_groups([], "tokens") == loss_groups([], "keys") == []
    with pytest.raises(ValueError, match="'samples'"):
        loss_groups(keys, "samples")


@pytest.mark.parametrize("weight", ["tokens", "keys"])
def test_offpolicy_weights_in_micro_batches_equal_one_forward_of_its_loss(policies, weight):
    """The `lm` loss with the offpolicy token weights, in micro-batches that cut across groups, gives the value and
    gradients of the plain formula in one forward: per group the cross-entropy summed over its masked tokens / their
    count, averaged over the groups. Ragged lengths, groups of one sample and of several, masks with holes (tool
    output between turns)."""
    model, _ = load_model(policies["init"], dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    vocab = model.text_config.vocab_size
    batch, keys = [], []
    for i, (n, key) in enumerate([(9, "a"), (23, "b"), (5, "a"), (14, "c"), (31, "b"), (7, "b")]):
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [False] * 3 + [j % 5 != 2 for j in range(n - 3)]
        batch.append((ids, mask))
        keys.append(key)
    groups = loss_groups(keys, weight)

    model.zero_grad(set_to_none=True)
    weights = offpolicy_weights([mask for _, mask in batch], groups)
    got = 0.0
    for chunk in micro_batches([len(ids) for ids, _ in batch], 24):
        assert len(chunk) < len(batch)
        tb = TokenBatch.from_sequences([batch[i][0] for i in chunk], [batch[i][1] for i in chunk],
                                       fields={"token_weight_T": [weights[i] for i in chunk]})  # fmt: skip
        scores = Scores(tb.targets_T, model.forward_batch(tb.forward_batch(torch.device("cpu"))))
        loss, _ = get_loss("lm")(scores, tb, LossConfig(), Normalizers(tokens=0, sequences=0))
        loss.backward()
        got += loss.item()
    got_grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    logps = sequence_logprobs(model, [ids for ids, _ in batch])
    terms = []
    for members in groups:
        nll = sum(-(logps[i] * torch.tensor(batch[i][1][1:], dtype=torch.float32)).sum() for i in members)
        terms.append(nll / sum(sum(batch[i][1][1:]) for i in members))
    want = torch.stack(terms).mean()
    want.backward()
    assert got == pytest.approx(want.item(), rel=1e-5)
    assert got_grads.keys() == {k for k, p in model.named_parameters() if p.grad is not None}
    for k, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got_grads[k], p.grad, rtol=1e-4, atol=1e-4 * float(p.grad.abs().max()))
    if weight == "keys":  # and it is not the token mean: key "a" has few tokens and weighs a third here
        token_mean = -sum((logps[i] * torch.tensor(m[1:], dtype=torch.float32)).sum() for i, (_, m) in
                          enumerate(batch)) / sum(sum(m[1:]) for _, m in batch)  # fmt: skip
        assert abs(token_mean.item() - got) > 1e-4


def test_offpolicy_weight_keys_trains_each_key_and_needs_offpolicy(policies, fleet, tmp_path):
    cfg = _config(policies, tmp_path / "run", f"calculator={policies['a']},files:max={policies['b']}",
                  method="offpolicy", offpolicy_weight="keys", steps=1, lr_decay_steps=1)  # fmt: skip
    trainer = _trainer(cfg, fleet)
    try:
        row = trainer.train_step()
        rates = {g["lr"] for g in trainer.optimizer.param_groups}
    finally:
        trainer.close()
    assert row["trained_by_key"] == {"calculator": 2, "files:max": 2}
    assert row["lr"] == pytest.approx(cfg.lr * cfg.lr_min_ratio) and rates == {row["lr"]}  # the decayed last step
    assert torch.isfinite(torch.tensor(row["loss"])) and row["loss"] > 0
    with pytest.raises(ValueError, match="--offpolicy-weight"):
        _config(policies, tmp_path / "bad", f"calculator={policies['a']}", offpolicy_weight="keys")


def test_held_out_evaluation_has_no_wall_clock_unless_given_and_counts_what_it_cuts(policies, fleet):
    """The benchmark's evaluation shares one engine over every episode, so a wall clock would judge the machine's
    load: none by default, and a finite one's cuts are counted (as failures), not hidden."""
    model, folder = load_model(policies["init"], dtype=torch.float32)
    tokenizer = load_tokenizer(folder, model.text_config)
    keys = [TeacherKey("calculator"), TeacherKey("files", "low")]
    kw = {"tagged": True, "max_turns": 2, "max_tokens": 16, "max_tokens_per_turn": 8}
    free = evaluate_policy(model.eval(), tokenizer, keys, 2, fleet, **kw)
    cut = evaluate_policy(model.eval(), tokenizer, keys, 2, fleet, wall_clock_s=0.0, **kw)
    assert sorted(free) == sorted(cut) == ["calculator", "files:low"]
    assert all(got["wall_clock_cut"] == 0 for got in free.values())
    assert all(got == {"success": 0.0, "length": got["length"], "wall_clock_cut": 2} for got in cut.values())


def test_held_out_evaluation_from_a_later_task_runs_exactly_those_tasks(policies, fleet):
    """`first` gives a second held-out set (`distill_reeval.py --first`): the test split's tasks first .. first +
    tasks - 1, each seeded by its own index, so a task scores the same in either set."""
    model, folder = load_model(policies["init"], dtype=torch.float32)
    tokenizer = load_tokenizer(folder, model.text_config)
    key = TeacherKey("files", "low")
    kw = {"tagged": True, "max_turns": 2, "max_tokens": 16, "max_tokens_per_turn": 8, "temperature": 1.0}
    whole = policy_episodes(model.eval(), tokenizer, [key], 5, fleet, **kw)[key]
    later = policy_episodes(model.eval(), tokenizer, [key], 2, fleet, first=3, **kw)[key]
    assert [t.task.task_id for t in later] == ["files/test/3", "files/test/4"] and [t.sample for t in later] == [3, 4]
    assert [t.task for t in later] == [t.task for t in whole[3:]]
    assert [t.tokens for t in later] == [t.tokens for t in whole[3:]]
    with pytest.raises(ValueError, match="first must be >= 0"):
        policy_episodes(model.eval(), tokenizer, [key], 2, fleet, first=-1, **kw)
    # several samples of training tasks (what a teacher generates for offpolicy data), in task order, each seeded
    # by its own number: the same task and sample number give the same episode
    train = policy_episodes(model.eval(), tokenizer, [key], 2, fleet, first=1, split="train", samples=2, **kw)[key]
    assert [t.task.task_id for t in train] == ["files/train/1"] * 2 + ["files/train/2"] * 2
    assert [t.sample for t in train] == [2, 3, 4, 5] and train[0].task == train[1].task
    again = policy_episodes(model.eval(), tokenizer, [key], 1, fleet, first=2, split="train", samples=2, **kw)[key]
    assert [t.sample for t in again] == [4, 5] and [t.tokens for t in again] == [t.tokens for t in train[2:]]
    with pytest.raises(ValueError, match="samples must be >= 1"):
        policy_episodes(model.eval(), tokenizer, [key], 2, fleet, samples=0, **kw)


# ---- configuration and registry errors -------------------------------------------------------------------------
def test_teacher_spec_parsing_and_its_errors():
    spec = parse_teachers("calculator=/a, files:low=/b,files:max=/c")
    assert spec == {TeacherKey("calculator"): "/a", TeacherKey("files", "low"): "/b", TeacherKey("files", "max"): "/c"}
    assert str(TeacherKey("files", "low")) == "files:low" and TeacherKey("files", "low").thinking
    cases = {"": "no teacher", "calculator": "domain\\[:effort\\]=CHECKPOINT", "cooking=/a": "unknown domain",
             "files:huge=/a": "unknown effort", "files=/a,files=/b": "given twice",
             "files=/a,files:low=/b": "with and without an effort"}  # fmt: skip
    for text, match in cases.items():
        with pytest.raises(ValueError, match=match):
            parse_teachers(text)


def test_a_teacher_with_another_vocabulary_is_a_named_error(policies, tmp_path):
    config = K3Config.preset("tiny")
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    other_tok = train_bpe(["completely different words for another tokenizer"] * 10, text.vocab_size, special)
    model, _ = load_model(policies["init"], dtype=torch.float32)
    other = _save(model, other_tok, tmp_path / "other")
    student_tok = train_bpe([WORDS] * 10, text.vocab_size, special)
    with pytest.raises(VocabularyMismatch, match="files:low"):
        TeacherRegistry({TeacherKey("files", "low"): other}, student_tok, text)
    bigger = dataclasses.replace(text, vocab_size=text.vocab_size + 64)
    with pytest.raises(VocabularyMismatch, match="vocab_size"):
        TeacherRegistry({TeacherKey("calculator"): policies["init"]}, student_tok, bigger)
    with pytest.raises(FileNotFoundError, match="calculator"):
        TeacherRegistry({TeacherKey("calculator"): str(tmp_path / "missing")}, student_tok, text)


def test_teachers_loaded_in_turn_score_like_resident_ones(policies):
    config = K3Config.preset("tiny").text_config
    from openk3.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(policies["init"], config)
    spec = {TeacherKey("calculator"): policies["a"]}
    resident, in_turn = TeacherRegistry(spec, tokenizer, config), TeacherRegistry(spec, tokenizer, config, "turn")
    seq = [tokenizer.encode(WORDS)]
    with torch.no_grad(), resident.use(TeacherKey("calculator")) as a, in_turn.use(TeacherKey("calculator")) as b:
        assert torch.equal(sequence_logprobs(a, seq)[0], sequence_logprobs(b, seq)[0])
    assert resident.loads == 1 and in_turn.loads == 1
    with in_turn.use(TeacherKey("calculator")):
        pass
    assert in_turn.loads == 2  # loaded again for each use
    with pytest.raises(KeyError, match="files"), resident.use(TeacherKey("files", "low")):
        pass


def test_config_errors_name_the_flag(policies, tmp_path):
    teachers = f"files:low={policies['a']}"
    with pytest.raises(ValueError, match="--init"):
        DistillConfig(teachers=teachers, out=str(tmp_path / "x"))  # the budget's b0 needs the cold start
    DistillConfig(teachers=teachers, out=str(tmp_path / "x"), budget_weight=0.0)  # no budget: no init needed
    with pytest.raises(ValueError, match="--tau-final"):
        DistillConfig(teachers=f"files:high={policies['a']}", out=str(tmp_path / "x"), init=policies["init"],
                      tau_final="low=0.5")  # fmt: skip
    with pytest.raises(ValueError, match="--r-max"):
        DistillConfig(teachers=teachers, out=str(tmp_path / "x"), init=policies["init"], r_max=0)
    with pytest.raises(ValueError, match="--method"):
        DistillConfig(teachers=teachers, out=str(tmp_path / "x"), init=policies["init"], method="magic")
    cfg = DistillConfig(teachers=f"calculator={policies['a']},files:low={policies['b']}", out=str(tmp_path / "x"),
                        init=policies["init"], task="ignored")  # fmt: skip
    assert cfg.families == ["calculator", "files"]
    assert cfg.weights == (1.0, 0.0, 1.0)
    assert DistillConfig(teachers=teachers, out=str(tmp_path / "x"), init=policies["init"], method="rl").weights == (
        0.0, 1.0, 1.0)  # fmt: skip


def test_cli_reports_a_bad_spec_without_a_traceback(capsys, tmp_path):
    from openk3.cli import main

    rc = main(["distill", "--teachers", "cooking=/nowhere", "--out", str(tmp_path / "run"), "--steps", "1"])
    assert rc == 2
    assert "unknown domain 'cooking'" in capsys.readouterr().err


class _NoFleet:
    """The ranks of the layout test train on injected trajectories: they start no sandbox."""

    def close(self) -> None: ...


def _distill_rank(rank: int, world: int, cfg: DistillConfig, trajs, steps: int):
    trainer = DistillTrainer(cfg, log=lambda *a, **k: None, fleet=_NoFleet())
    rows = []
    for _ in range(steps):
        rows.append(trainer.update(trajs))
        trainer.step += 1
        trainer.version += 1
    weights = {name: t.clone() for name, t in trainer.sync.full_tensors(trainer.model)}
    trainer.close()
    return {"rows": rows, "weights": weights if rank == 0 else None}


@pytest.mark.parametrize("method, layout", [("opd", {"dp": 2}), ("topk", {"ep": 2})], ids=["opd-dp2", "topk-ep2"])
def test_sharded_distillation_equals_one_process(policies, fleet, tmp_path, method, layout):
    """`k3 distill` trains on the same core at any layout: the same trajectories (injected), 2 updates on 2 gloo ranks
    give the one-process losses and weights (1e-5 relative), teacher scores and top-k targets included."""
    from tests.parallel.dist_helpers import run_ranks

    teachers = f"calculator={policies['a']},files:max={policies['b']}"
    single = _trainer(_config(policies, tmp_path / "one", teachers, method=method, group_size=3), fleet)
    trajs = single._new_trajectories()
    single.worker.run(trajs, single.version)
    sendable = [dataclasses.replace(t, env=None) for t in trajs]
    laid_out = _config(policies, tmp_path / "laid-out", teachers, method=method, group_size=3, **layout)
    ranks = run_ranks(2, _distill_rank, laid_out, sendable, 2)
    want = []
    for _ in range(2):
        want.append(single.update(trajs))
        single.step += 1
        single.version += 1
    weights, want_w = ranks[0]["weights"], {k: v.clone() for k, v in single.model.state_dict().items()}
    single.worker.close(trajs)
    single.close()
    for g, w in zip(ranks[0]["rows"], want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-8)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5) and w["grad_norm"] > 0
    diff = sum(float((weights[k] - t).double().square().sum()) for k, t in want_w.items()) ** 0.5
    norm = sum(float(t.double().square().sum()) for t in want_w.values()) ** 0.5
    assert diff / norm <= 1e-5


def test_a_teacher_with_another_tokenizer_stops_the_run_before_any_work(policies, fleet, tmp_path):
    config = K3Config.preset("tiny")
    text = config.text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    model, _ = load_model(policies["init"], dtype=torch.float32)
    other = _save(model, train_bpe(["entirely other words"] * 10, text.vocab_size, special), tmp_path / "other")
    out = tmp_path / "run"
    with pytest.raises(VocabularyMismatch, match="calculator"):
        _trainer(_config(policies, out, f"calculator={other}"), fleet)
    assert not out.exists()  # no config, no checkpoint, no engine or sandbox started
