"""Multi-teacher on-policy distillation (MOPD, K3 report Eq. 15): `k3 distill`.

K3 trains one RL expert per domain and thinking effort and distils them into one student on-policy: the student
samples (on the RL loop's engine and environments, multi-turn tool use and partial rollouts included), every sampled
token y_t of an episode with domain d and effort e is scored by the teacher of (d, e), and

    r_opd(y_t) = clip( sg( log π_teacher^(d,e)(y_t | x, y_<t) − log π_θ(y_t | e, x, y_<t) ), −R_max, R_max )

is a dense per-token reward inside the same RL losses (the `opd` loss of train/losses.py). The student's prompt carries the
effort tag (XTML's thinking-effort message); the teacher, an expert of that effort, sees the episode without it: its
context is its own prompt followed by the student's tokens verbatim (`teacher_tokens`). Each teacher scores all of its
tokens of a step in one batched forward, and the student's log-probs for the reward come from a forward batched the
same way (natural routing both), so a teacher with the student's weights gives a reward of exactly 0.

The per-token advantage of a trajectory's generated tokens is

    A_t = opd_weight * r_opd(y_t) + group_advantage( task_weight * task_reward + budget_weight * budget_reward )

Effort is taught by a budget (K3): b0(x) is the response length (generated tokens of the episode) of the cold-start
model (`--init`) on task x, greedy, at the highest effort its domain is distilled at, measured once per task; an
episode at effort e longer than τ_e·b0(x) gets a budget reward of −1, else 0. τ_e anneals linearly from `tau_start`
to its final value (`tau_final`, e.g. low 0.5, high 0.8, max 1.5) over `tau_anneal_steps` steps.

Baselines in the same command (`--method`): `opd` (above); `rl` (the task and budget rewards only, from the same
start: the RL the distillation is compared with); `topk` (a distribution target instead of the sampled token: the
forward KL from the teacher's top-k next-token distribution, renormalised, to the student, on the student's own
samples); `offpolicy` (SFT on teacher samples: each step the teachers generate the step's episodes in their own
context and the student is trained by cross-entropy on those tokens behind its own, effort-tagged prompt;
`--offpolicy-keep solved` keeps only the samples that solve their task: rejection sampling, as in distilling from
filtered teacher outputs; `--offpolicy-weight keys` makes the loss the mean over the step's teacher keys of each key's
token mean, instead of one mean over all kept tokens, so a domain of short answers weighs as much as a long one).

The teacher's distribution is softmax(logits / `teacher_temperature`) in every method: its scores (opd), its
top-k target (topk) and its samples (offpolicy). The default 1 is Eq. 15 as written; below 1 the target is sharper
than the teacher samples, a knob K3's report does not name (measured in docs/distill.md).

Legend: T packed tokens (positions 0..n-2 of every trajectory, as `logprobs.sequence_logprobs` returns them), V
vocabulary, S trajectories.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import replace
from functools import partial

import torch

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer
from openk3.rl.advantages import group_advantages
from openk3.rl.distill_config import CONFIG_FILE, METHODS, DistillConfig, TauSchedule, parse_tau_final  # noqa: F401
from openk3.rl.envs import Task, get_family, initial_messages
from openk3.rl.evaluate import SUCCESS, episode_results, summarize
from openk3.rl.logprobs import sequence_log_softmax, sequence_logprobs
from openk3.rl.loop import RLTrainer, _task_index, engine_config
from openk3.rl.rollout import RolloutWorker, Trajectory
from openk3.rl.teachers import TeacherKey, TeacherRegistry, top_efforts
from openk3.rl.transcript import prompt_ids
from openk3.train.batch import TokenBatch, micro_batches
from openk3.train.losses import opd_reward


# ---- the rewards -----------------------------------------------------------------------------------------------
def budget_reward(length: int, b0: float, tau: float) -> float:
    """−1 for a response longer than τ·b0 tokens, else 0 (K3's effort budget)."""
    return -1.0 if length > tau * b0 else 0.0


# ---- the trainer -----------------------------------------------------------------------------------------------
def loss_groups(keys: list[str], weight: str) -> list[list[int]]:
    """The groups of an offpolicy batch whose token means are averaged into the step's loss: one group of every
    sample (`weight` "tokens": each kept token weighs the same), or one per teacher key, keys in order ("keys": each
    key present weighs the same, whatever its samples' number and lengths). `keys`: each sample's teacher key."""
    if weight == "tokens":
        return [list(range(len(keys)))] if keys else []
    if weight != "keys":
        raise ValueError(f"offpolicy weight {weight!r}: expected tokens or keys")
    by_key = defaultdict(list)
    for i, key in enumerate(keys):
        by_key[key].append(i)
    return [by_key[k] for k in sorted(by_key)]


def offpolicy_weights(masks: list[list[bool]], groups: list[list[int]]) -> list[torch.Tensor]:
    """Per example, the weight of each of its positions in the `lm` loss L = mean over `groups` of (the group's
    cross-entropy summed over its masked tokens / their count): 1 / (the group's mask tokens x the number of
    groups). `masks`: every example's loss mask (position t scores token t + 1, so entry 0 never counts)."""
    out: list[torch.Tensor | None] = [None] * len(masks)
    for members in groups:
        n_group = sum(sum(masks[i][1:]) for i in members)
        for i in members:
            out[i] = torch.full((len(masks[i]) - 1,), 1.0 / max(n_group, 1) / len(groups))
    return out


class DistillTrainer(RLTrainer):
    cfg: DistillConfig
    command = "k3 distill"

    def __init__(self, cfg: DistillConfig, log=print, fleet=None):
        self._specs = cfg.teacher_specs
        self.keys = sorted(self._specs)
        super().__init__(cfg, log=log, fleet=fleet)
        self.loss_config = replace(self.loss_config, opd_weight=cfg.weights[0], r_max=cfg.r_max)
        self.tau = cfg.tau
        self.b0: dict[str, int] = getattr(self, "_resume_b0", {})
        self._cold_worker = None  # the cold-start model's worker, built when a b0 is first needed
        self._teacher_workers: dict[TeacherKey, RolloutWorker] = {}
        self.score_s = 0.0  # time spent in teacher forwards (and teacher loads, in turn)

    def _check_sources(self) -> None:
        """The teachers: each must speak the student's tokenizer and vocabulary (a VocabularyMismatch names it)."""
        self.teachers = TeacherRegistry(self._specs, self.tokenizer, self.model.text_config, self.cfg.residency)

    def _fresh_policy(self):
        """A fresh `preset` student speaking the teachers' vocabulary (the first teacher's tokenizer)."""
        from openk3.train.checkpoint import build_model, resolve_checkpoint

        folder = resolve_checkpoint(self._specs[self.keys[0]])
        config = K3Config.preset(self.cfg.preset)
        tokenizer = load_tokenizer(folder, config.text_config)
        model = build_model(config)
        model.init_weights(torch.Generator().manual_seed(self.cfg.seed))
        return model, tokenizer

    @property
    def step_episodes(self) -> int:
        """An offpolicy step samples one key's tasks at a time, each `draws` times (best of N may draw more than
        --group-size); a step's tasks are dealt round-robin to the keys."""
        if self.cfg.method != "offpolicy":
            return super().step_episodes
        tasks_per_key = -(-self.cfg.groups_per_step // len(self.keys))
        return max(self.cfg.draws.values()) * tasks_per_key  # draws: --group-size where not given

    @property
    def eval_episodes(self) -> int:
        return self.cfg.eval_tasks * len(self.keys)  # one set of test tasks per key, not per domain

    # ---- tasks -------------------------------------------------------------------------------------------------
    def key_of(self, traj: Trajectory) -> TeacherKey:
        return TeacherKey(traj.task.family, traj.effort)

    def _step_tasks(self) -> list[tuple[int, TeacherKey, Task]]:
        """The step's `groups_per_step` (group, key, task), round-robin over the teacher keys."""
        out = []
        for _ in range(self.cfg.groups_per_step):
            group = self.task_counter
            self.task_counter += 1
            key = self.keys[group % len(self.keys)]
            out.append((group, key, get_family(key.domain).generate("train", _task_index(self.cfg.seed, group))))
        return out

    def _new_trajectories(self) -> list[Trajectory]:
        """This rank's share of the step's tasks (every world-th group), `group_size` samples each, effort-tagged."""
        out = [self.worker.start(task, group=group, sample=s, thinking=key.thinking, effort=key.effort)
               for group, key, task in self._step_tasks() if group % self.sync.world == self.sync.rank
               for s in range(self.cfg.group_size)]  # fmt: skip
        if self.cfg.uses_budget:
            self._measure_b0(out)
        return out

    def _by_key(self, trajs: list[Trajectory]) -> list[tuple[TeacherKey, list[int]]]:
        """The indices of `trajs` per teacher key, keys in order."""
        by_key = defaultdict(list)
        for i, t in enumerate(trajs):
            by_key[self.key_of(t)].append(i)
        return sorted(by_key.items())

    def _key_means(self, trajs: list[Trajectory]) -> tuple[dict[str, float], dict[str, float]]:
        """(success rate, mean generated tokens) per teacher key's name."""
        success, length = {}, {}
        for key, idx in self._by_key(trajs):
            success[str(key)] = sum(trajs[i].reward >= SUCCESS for i in idx) / len(idx)
            length[str(key)] = sum(trajs[i].num_generated for i in idx) / len(idx)
        return success, length

    # ---- the effort budget -------------------------------------------------------------------------------------
    def _measure_b0(self, trajs: list[Trajectory]) -> None:
        """b0(x) for each new effort-tagged task: the cold-start model's greedy episode length at the domain's
        highest effort."""
        tasks = {t.task.task_id: t.task for t in trajs if t.effort is not None and t.task.task_id not in self.b0}
        if not tasks and self.sync.world == 1:
            return
        worker = self._cold()
        top = top_efforts(self.keys)
        episodes = [worker.start(task, group=-2, sample=0, effort=top[task.family]) for task in tasks.values()]
        worker.run(episodes, version=0, temperature=0.0)
        measured = {traj.task.task_id: max(traj.num_generated, 1) for traj in episodes}
        for part in self.sync.gather_results([measured]):  # every rank reads every task's budget
            self.b0.update(part)

    def _cold(self) -> RolloutWorker:
        if self._cold_worker is None:
            from openk3.serve.engine import LLMEngine
            from openk3.train.checkpoint import load_model

            model, _ = load_model(self.cfg.init, dtype=torch.float32)
            model.eval().requires_grad_(False)
            engine = LLMEngine(model, self.tokenizer, engine_config(self.cfg, self.cfg.groups_per_step))
            self._cold_worker = RolloutWorker(engine, self.tokenizer, self.fleet, self.worker.budgets,
                                              snapshots=self.snapshots, max_tokens_per_turn=self.cfg.max_tokens_per_turn,
                                              seed=self.cfg.seed)  # fmt: skip
        return self._cold_worker

    def budget(self, traj: Trajectory, step: int) -> float:
        if traj.effort is None or traj.task.task_id not in self.b0:
            return 0.0
        return budget_reward(traj.num_generated, self.b0[traj.task.task_id], self.tau(traj.effort, step))

    # ---- teacher scoring ---------------------------------------------------------------------------------------
    def teacher_tokens(self, traj: Trajectory) -> tuple[list[int], int]:
        """(the teacher's context of `traj`, the shift d: student position j is teacher position j + d): the
        teacher's own prompt (no effort tag) followed by the student's episode tokens verbatim."""
        prompt = prompt_ids(initial_messages(traj.task), traj.task.tools, self.tokenizer, thinking=traj.thinking)
        return prompt + traj.tokens[traj.prompt_len :], len(prompt) - traj.prompt_len

    def opd_scores(self, trajs: list[Trajectory]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per trajectory, (the teacher's log-probs [n - 1], the student's [n - 1]) at the student's positions (0
        before the first generated token): one no-grad forward per teacher over all of its trajectories, and one
        student forward over the same trajectories, both with natural routing."""
        teacher_lps = [torch.zeros(len(t.tokens) - 1) for t in trajs]
        student_lps = [torch.zeros(len(t.tokens) - 1) for t in trajs]
        t0 = time.perf_counter()
        forward = partial(sequence_logprobs, temperature=self.cfg.teacher_temperature)
        for idx, theirs in self._teacher_forward(trajs, forward):
            with torch.no_grad():
                ours = sequence_logprobs(self._policy_for_scoring(), [trajs[i].tokens for i in idx])
            for i, (start, t_lp), s_lp in zip(idx, theirs, ours):
                teacher_lps[i][start:] = t_lp
                student_lps[i][start:] = s_lp[start:].detach().cpu()
        self.score_s += time.perf_counter() - t0
        return teacher_lps, student_lps

    def opd_rewards(self, trajs: list[Trajectory]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per trajectory, (r_opd [n - 1], teacher log-probs [n - 1]) at the student's positions (0 before the first
        generated token)."""
        teacher_lps, student_lps = self.opd_scores(trajs)
        return [opd_reward(t, s, self.cfg.r_max) for t, s in zip(teacher_lps, student_lps)], teacher_lps

    def _policy_for_scoring(self):
        """The student whose log-probs enter the reward: the trainer's model in one process; a whole copy of it on
        each rank of a laid-out run (scoring is rank-local, so no rank waits for another's collectives)."""
        if self.sync.world == 1:
            return self.model
        if getattr(self, "_scoring_version", None) != self.version:
            self._scoring_copy, self._scoring_version = self._policy_copy(), self.version
        return self._scoring_copy

    def _teacher_forward(self, trajs: list[Trajectory], forward):
        """Per teacher key: (indices into `trajs`, per index (start, rows)), from one no-grad `forward(teacher,
        contexts)` over all of the key's trajectories; `rows` are the teacher's outputs at the student's positions
        start.. (start = the position scoring the first episode token; the prompts differ, the episodes do not)."""
        for key, idx in self._by_key(trajs):
            contexts = [self.teacher_tokens(trajs[i]) for i in idx]
            with torch.no_grad(), self.teachers.use(key) as teacher:
                outs = forward(teacher, [c for c, _ in contexts])
            starts = [trajs[i].prompt_len - 1 for i in idx]
            yield idx, [(start, out[start + shift :]) for start, (_, shift), out in zip(starts, contexts, outs)]

    @property
    def loss_name(self) -> str:
        if self.cfg.method == "topk":
            return "topk_kl"
        if self.cfg.method == "offpolicy":
            return "lm"
        return "opd" if self.cfg.weights[0] > 0 else self.cfg.loss

    def token_fields(self, trajs):
        """Group advantages of task_weight x task reward + budget_weight x budget reward; with the opd reward, the
        teacher's and the student's scores of every token (the `opd` loss adds the clipped reward)."""
        opd_w, task_w, budget_w = self.cfg.weights
        budgets = [self.budget(t, self.step) for t in trajs]
        rewards_S = torch.tensor([task_w * t.reward + budget_w * b for t, b in zip(trajs, budgets)])
        adv_S = group_advantages(
            rewards_S, torch.tensor([t.group for t in trajs]), normalize_std=self.cfg.normalize_std
        )
        fields = {"advantages_T": [adv_S[i].expand(len(t.tokens) - 1) for i, t in enumerate(trajs)]}
        metrics = {"budget_penalty_rate": sum(b < 0 for b in budgets) / len(trajs),
                   "tau": {e: self.tau(e, self.step) for e in sorted({t.effort for t in trajs if t.effort})}}  # fmt: skip
        if opd_w > 0:
            fields["teacher_logp_T"], fields["student_logp_T"] = self.opd_scores(trajs)
        return fields, metrics

    def batch_fields(self, batch: list[Trajectory]) -> dict[str, list[torch.Tensor]]:
        """topk: the teacher's top-k ids and renormalised probabilities of each micro-batch, scored with it."""
        if self.cfg.method != "topk":
            return {}
        t0 = time.perf_counter()
        targets = self._teacher_topk(batch)
        self.score_s += time.perf_counter() - t0
        return {"teacher_topk_ids_Tk": [ids for ids, _ in targets], "teacher_topk_probs_Tk": [q for _, q in targets]}

    # ---- the update of each method -----------------------------------------------------------------------------
    def train_step(self) -> dict:
        if self.cfg.method == "offpolicy":
            return self._offpolicy_step()
        return super().train_step()

    def update(self, trajs: list[Trajectory]) -> dict:
        row = super().update(trajs)
        if self.cfg.method == "topk":
            row["forward_kl_topk"] = row["loss"]  # the topk_kl loss is the forward KL itself
        return row

    def _teacher_topk(self, batch: list[Trajectory]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out: list = [None] * len(batch)
        forward = partial(sequence_log_softmax, temperature=self.cfg.teacher_temperature)
        for idx, rows in self._teacher_forward(batch, forward):
            for i, (start, lp_nV) in zip(idx, rows):
                # before the episode: any finite row (masked out of the loss)
                aligned = torch.cat([lp_nV.new_zeros(start, lp_nV.shape[-1]), lp_nV])
                top_lp, top_ids = aligned.topk(self.cfg.topk, dim=-1)
                out[i] = (top_ids, torch.softmax(top_lp, dim=-1))
        return out

    def _offpolicy_step(self) -> dict:
        """SFT on teacher samples: the step's tasks are generated by their teachers (own context, at the teacher
        temperature), and the student is trained by cross-entropy on the teachers' tokens behind its own
        effort-tagged prompt (on the samples that solve their task only, with `offpolicy_keep` "solved"; a step that
        keeps none makes no update). With `offpolicy_draws` a teacher samples more episodes of a task than the group
        size and the first group-size ones that solve it are kept: best of N."""
        cfg = self.cfg
        t_step = time.perf_counter()
        lr = self.rate(self.step)
        by_key = defaultdict(list)
        for group, key, task in self._step_tasks():
            if group % self.sync.world == self.sync.rank:  # this rank's share of the tasks
                by_key[key].append((group, task))
        batch, batch_keys, rewards, lengths = [], [], [], []
        covered = {}  # per key: (tasks with a sample kept, tasks) of this rank
        gen_tokens = 0
        draws = cfg.draws
        for key, tasks in sorted(by_key.items()):
            worker = self._teacher_worker(key)
            samples = [worker.start(task, group=group, sample=s, thinking=key.thinking)
                       for group, task in tasks for s in range(draws[str(key)])]  # fmt: skip
            worker.run(samples, version=0, temperature=cfg.teacher_temperature)
            kept = Counter()  # per task (group): at most --group-size samples, the first that solve it
            for sample in samples:
                rewards.append(sample.reward)
                lengths.append(sample.num_generated)
                gen_tokens += sample.num_generated
                if cfg.offpolicy_keep == "solved" and (sample.reward < SUCCESS or kept[sample.group] >= cfg.group_size):
                    continue
                kept[sample.group] += 1
                # the student's own effort-tagged prompt (no sandbox needed for it), then the teacher's episode
                prompt = prompt_ids(initial_messages(sample.task), sample.task.tools, self.tokenizer,
                                    thinking=key.thinking, effort=key.effort)  # fmt: skip
                tokens = prompt + sample.tokens[sample.prompt_len :]
                mask = [False] * len(prompt) + sample.generated[sample.prompt_len :]
                batch.append((tokens, mask))
                batch_keys.append(str(key))
            covered[str(key)] = (len(kept), len(tasks))  # reading a Counter's missing group adds no entry
        t_rollout = time.perf_counter() - t_step
        t0 = time.perf_counter()
        # Every rank sampled its share of the tasks; each trains on its share of all ranks' kept samples.
        parts = self.sync.gather_results([(batch, batch_keys, rewards, lengths, covered, gen_tokens)])
        batch = [x for p in parts for x in p[0]]
        batch_keys = [x for p in parts for x in p[1]]
        rewards, lengths = [x for p in parts for x in p[2]], [x for p in parts for x in p[3]]
        counts = defaultdict(lambda: [0, 0])
        for p in parts:
            for k, (n_kept, n_tasks) in p[4].items():
                counts[k][0] += n_kept
                counts[k][1] += n_tasks
        covered = {k: n_kept / n_tasks for k, (n_kept, n_tasks) in sorted(counts.items())}
        gen_tokens = sum(p[5] for p in parts)
        weights = offpolicy_weights([mask for _, mask in batch], loss_groups(batch_keys, cfg.offpolicy_weight))
        lo, hi = self.sync.share(len(batch))
        mine = list(range(lo, hi))
        mbs = []
        for chunk in micro_batches([len(batch[i][0]) for i in mine], cfg.micro_batch_tokens):
            idx = [mine[j] for j in chunk]
            mbs.append(TokenBatch.from_sequences([batch[i][0] for i in idx], [batch[i][1] for i in idx],
                                                 fields={"token_weight_T": [weights[i] for i in idx]}))  # fmt: skip
        mbs += [TokenBatch.padding_batch()] * (self.sync.max_over_ranks(len(mbs)) - len(mbs))
        out = {"loss": 0.0, "grad_norm": 0.0}
        if batch:  # a step that keeps no sample makes no update
            out = self.core.step(mbs, "lm", lr)
        total, grad_norm = out["loss"], out["grad_norm"]
        t_train = time.perf_counter() - t0
        self.step += 1
        self.version += 1
        self._publish()
        n = max(len(rewards), 1)
        return {"step": self.step, "lr": lr, "loss": total, "grad_norm": float(grad_norm), "reward": sum(rewards) / n,
                "teacher_reward": sum(rewards) / n, "response_tokens": sum(lengths) / n, "logprob_gap": 0.0,
                "kept_fraction": len(batch) / n,
                "rollout_tokens_per_s": gen_tokens / max(t_rollout, 1e-9), "train_share": t_train / (time.perf_counter()
                - t_step), "step_s": time.perf_counter() - t_step, "routing_replay": cfg.routing_replay,
                "version": self.version, "trained_sequences": len(batch),
                "trained_by_key": dict(sorted(Counter(batch_keys).items())), "covered_by_key": covered}  # fmt: skip

    def _teacher_worker(self, key: TeacherKey) -> RolloutWorker:
        if key not in self._teacher_workers:
            from openk3.serve.engine import LLMEngine

            model = self.teachers.resident(key)
            engine = LLMEngine(model, self.tokenizer, engine_config(self.cfg, self.step_episodes))
            worker = RolloutWorker(engine, self.tokenizer, self.fleet, self.worker.budgets, snapshots=self.snapshots,
                                   max_tokens_per_turn=self.cfg.max_tokens_per_turn, seed=self.cfg.seed)  # fmt: skip
            self._teacher_workers[key] = worker
        return self._teacher_workers[key]

    # ---- metrics and evaluation --------------------------------------------------------------------------------
    def _rollout_metrics(self, trajs, stats, dropped, t_rollout, t_train, t_total) -> dict:
        row = super()._rollout_metrics(trajs, stats, dropped, t_rollout, t_train, t_total)
        row["success"], row["response_tokens_by_key"] = self._key_means(trajs)
        row["score_s"] = self.score_s
        return row

    @property
    def eval_keys(self) -> list[TeacherKey]:
        return self.keys  # one set of test tasks per teacher key, effort-tagged as in training

    def evaluate(self, episodes: dict | None = None) -> dict:
        """Held-out success and mean response length (generated tokens) per teacher key."""
        trajs = self.held_out_episodes() if episodes is None else episodes
        summary = summarize(self.sync.gather_results(episode_results(trajs)))
        return {"eval_success": {k: v["success"] for k, v in sorted(summary.items())},
                "eval_length": {k: v["length"] for k, v in sorted(summary.items())}}  # fmt: skip

    # ---- checkpoint state --------------------------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {"b0": dict(self.b0)}

    def _load_extra_state(self, state: dict) -> None:
        self._resume_b0 = dict(state.get("b0", {}))
