"""The RL loop behind `k3 rl`: rollout -> advantages -> update -> publish, on one process or many.

Per step:
    1. rollout: `groups_per_step` tasks (round-robin over the families), `group_size` samples each, plus the
       trajectories a partial-rollout cut left unfinished, generated on the serving engine (`RolloutWorker.run`);
    2. the trajectories whose whole group is done are trained on; one with tokens older than `max_off_policy_steps`
       versions is dropped (bounded staleness), the rest wait for the next step;
    3. advantages: reward minus the group mean (GRPO); the update: one step of the training core (train/core.py)
       on the packed trajectories with the rollout's routed experts (routing replay) or its own routes, the
       registered policy loss (train/losses.py) against the rollout's behaviour log-probs, AdamW;
    4. publish: the new weights are copied into the engine in place (`LLMEngine.update_weights`, which invalidates
       its prefix cache by version) once the engine's weights would otherwise be more than `max_off_policy_steps`
       versions behind;
    5. one line in metrics.jsonl; held-out evaluation (greedy) every `eval_every` steps; atomic checkpoints.

Across processes (`k3 rl --nproc N --dp D --ep E`, gloo or NCCL under torchrun): every rank is a rollout worker with
its own engine and sandbox fleet and takes every N-th group; the finished trajectories go to every rank, each data
rank trains its share on the policy laid out like `k3 train`'s (FSDP2, EP), and the new weights reach every engine
gathered from the shards one tensor at a time (rl/weight_sync.py). The update equals one process's to rounding.

Measured per step: reward; success per family (reward 1); response length; turns; tool calls; rollout tokens/s;
the time shares of inference, sandboxes and training; staleness (trained version minus the version of each token);
the clip fraction; the rollout-vs-train log-prob gap of this version's tokens (`logprob_gap`: with routing replay
when it is on) and, on step 1 and every `gap_check_every` steps, the gap the other way (then `logprob_gap_replay`
and `logprob_gap_natural` both; one extra forward, so not every step).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import signal
import time
from collections import defaultdict

import torch

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer
from openk3.data.xtml import require_markers
from openk3.rl.advantages import group_advantages
from openk3.rl.config import RLConfig
from openk3.rl.env import Budgets, TaskSnapshots
from openk3.rl.envs import get_family
from openk3.rl.evaluate import SUCCESS, episode_results, held_out_episodes, summarize
from openk3.rl.logprobs import sequence_logprobs
from openk3.rl.rollout import RolloutStats, RolloutWorker, Trajectory
from openk3.rl.sft import CopyStream, DemoStream, fresh_policy
from openk3.rl.teachers import TeacherKey
from openk3.rl.warm_start import WarmStart, progress_bar
from openk3.rl.weight_sync import Sync
from openk3.serve.config import CheckpointPolicy, ServeConfig
from openk3.serve.engine import LLMEngine
from openk3.train.balance import Balancer
from openk3.train.batch import TokenBatch, micro_batches
from openk3.train.checkpoint import (
    CHECKPOINTS,
    OPTIMIZER_CHANGES,
    build_model,
    describe_changes,
    latest_checkpoint,
    load_model,
    resolve_checkpoint,
)
from openk3.train.core import NonFiniteError, TrainCore
from openk3.train.distributed import Layout
from openk3.train.losses import LossConfig
from openk3.train.optim import stable_then_decay
from openk3.train.trainer import _StopSignals, resolve_device, truncate_metrics
from openk3.utils import release_freed_memory

REFERENCE = "reference"  # the run's KL reference (the policy at the start of RL), a release-format folder


def engine_config(cfg: RLConfig, max_seqs: int) -> ServeConfig:
    """The rollout engine: routes recorded, small hash units so each turn resumes from the previous one."""
    return ServeConfig(max_model_len=cfg.max_model_len, max_num_seqs=max_seqs,
                       max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=cfg.prefix_caching,
                       hash_unit=8, block_size=64, checkpoint_policy=CheckpointPolicy(output_end=True),
                       record_routed_experts=True, cache_memory_bytes=cfg.cache_memory_mb * 2**20)  # fmt: skip


class RLTrainer(WarmStart):
    command = "k3 rl"  # how log lines name the run

    def __init__(self, cfg: RLConfig, log=print, fleet=None):
        """The run `cfg` in this process: a world of 1, or one rank of the process group it was started in, laid
        out by cfg.dp x cfg.ep x cfg.cp."""
        self.cfg = cfg
        described = self._described_model()
        num_experts = described.text_config.num_experts
        if num_experts % cfg.ep:
            raise ValueError(f"--ep {cfg.ep} must divide the model's {num_experts} routed experts")
        self.layout = Layout.of(cfg.dp, cfg.ep, cfg.cp, resolve_device(cfg.device))
        self.sync = Sync(self.layout)
        self.log = log if self.sync.is_main else (lambda *a, **k: None)
        torch.manual_seed(cfg.seed)
        ckpt = self._checkpoint_to_resume()
        if ckpt is not None:
            self.model = build_model(K3Config.from_pretrained(ckpt))
            self.tokenizer = load_tokenizer(ckpt, self.model.text_config)
        elif cfg.init is not None:
            self.model, folder = load_model(cfg.init, dtype=torch.float32)
            self.tokenizer = load_tokenizer(folder, self.model.text_config)
            require_markers(self.tokenizer)
        else:
            self.model, self.tokenizer = self._fresh_policy()
        if ckpt is not None:
            self._check_model_config(ckpt, described)
        self._check_sources()  # before any work starts and before anything in --out is written
        self.model.to(self.layout.device).train()
        self.layout.parallelize(self.model)
        # The router biases stay as they are during RL (no balancing); the Balancer only carries the checkpoint
        # format's balancing state, so `k3 generate/serve/export --ckpt RUN` read RL runs like training runs.
        balancer = Balancer(self.model, "none", process_group=self.layout.data_group)
        self.core = TrainCore(self.model, self.layout, None, balancer=balancer, grad_clip=cfg.grad_clip,
                              precision=cfg.precision)  # fmt: skip
        # The KL reference: the policy at the start of RL (after the warm start), made at the first update and kept in
        # `out/reference` so a resumed run reads the same weights back (`_kl_reference`).
        self.reference = None
        self.loss_config = LossConfig(kind=cfg.loss, eps_low=cfg.eps_low, eps_high=cfg.eps_high, average=cfg.average,
                                      correction=None if cfg.correction == "none" else cfg.correction,
                                      kl_coef=cfg.kl_coef)  # fmt: skip
        self.step, self.version, self.sft_done, self.copy_done = 0, 0, 0, 0
        self.demos = DemoStream(cfg.families, self.tokenizer, cfg.seed, cfg.sft_guess_share)
        self.copies = CopyStream(cfg.families, self.tokenizer, cfg.seed)
        self.task_counter = 0
        self.pending: list[Trajectory] = []  # unfinished (partial rollouts) or waiting for their group
        self.stopped_by: signal.Signals | None = None  # the signal that ended run(), if one did
        self._signals: _StopSignals | None = None  # installed while run() runs
        self.core.optimizer = self._optimizer(self._warm_phase_left(ckpt))
        if ckpt is not None:
            self._load_state(ckpt)
        # Every rank's engine serves the whole policy (gathered from the laid-out one).
        engine_model = self._policy_copy().eval().requires_grad_(False)
        max_seqs = max(self.step_episodes, self.eval_episodes)
        self.engine = LLMEngine(engine_model, self.tokenizer, engine_config(cfg, min(max_seqs, 256)))
        self.engine.weight_version = self.version
        self._own_fleet = fleet is None
        if fleet is None:
            from openk3.sandbox.fleet import Fleet

            fleet = Fleet(max_sandboxes=max_seqs + 8, warm=4, memory_mb=256)
        self.fleet = fleet
        self.snapshots = TaskSnapshots(fleet, max_tasks=4 * cfg.groups_per_step + self.eval_episodes)
        # The wall clock runs from an episode's reset, through training steps when a partial rollout continues it:
        # generous, so that only a stuck episode hits it.
        budgets = Budgets(max_turns=cfg.max_turns, max_tokens=cfg.max_tokens, wall_clock_s=600.0)
        self.worker = RolloutWorker(self.engine, self.tokenizer, fleet, budgets, snapshots=self.snapshots,
                                    max_tokens_per_turn=cfg.max_tokens_per_turn, seed=cfg.seed)  # fmt: skip
        if self.sync.is_main:
            cfg.save(cfg.out)

    # ---- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """The warm start (if not done), the step-0 evaluation, then RL steps up to --steps (or --stop-after more).
        SIGINT or SIGTERM (Ctrl-C) stops at the next step boundary, warm-start steps included, with a checkpoint the
        run resumes from (`--resume`); another one a moment later stops at once."""
        self._signals = _StopSignals(self.log).install()
        try:
            return self._run()
        finally:
            self._signals.restore()
            self._signals = None

    def _run(self) -> dict:
        cfg = self.cfg
        if self.copy_done < cfg.copy_steps or self.sft_done < cfg.sft_steps:
            self.warm_start()
            if self.stopped_by is not None:
                return {}
        last: dict = {}
        if self.step == 0:
            last = self._write({"step": 0, **self.evaluate()})
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.step + cfg.stop_after)
        bar = progress_bar(end, self.step, cfg.progress and self.sync.is_main, f"{self.command}: rl")
        try:
            while self.step < end:
                row = self.train_step()
                if row.get("skipped"):
                    self.log(f"{self.command}: step {self.step}: non-finite loss or gradient (loss {row['loss']}, grad "
                             f"norm {row['grad_norm']}); skipped ({self.core.nonfinite_run} in a row)")  # fmt: skip
                if self.step % cfg.eval_every == 0 or self.step == end:
                    row.update(self.evaluate())
                last = self._write(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row.get('reward', 0.0):.2f}", gap=f"{row.get('logprob_gap', 0.0):.1e}")
                if self.core.nonfinite_run >= cfg.max_nonfinite:
                    path = self.save()  # the weights of the last good step: skipped steps change nothing
                    raise NonFiniteError(f"{self.core.nonfinite_run} non-finite steps in a row (limit --max-nonfinite "
                                         f"{cfg.max_nonfinite}); stopped at step {self.step} with the last good "
                                         f"weights saved in {path}")  # fmt: skip
                stopping = self._stopping()
                if self.step % cfg.save_every == 0 or self.step == end or stopping:
                    path = self.save()
                if stopping:
                    self._report_stop(path)
                    break
        finally:
            bar.close()
        return last

    def _stopping(self) -> bool:
        """Whether a stop signal reached this process or, on several ranks, any rank (all stop at the same step)."""
        received = self._signals.received if self._signals is not None else None
        if self.sync.any_rank(received is not None):
            self.stopped_by = received or signal.SIGTERM  # SIGTERM: another rank's signal
            return True
        return False

    def _report_stop(self, path: str) -> None:
        flags = f" --nproc {self.sync.world}" if self.sync.world > 1 else ""
        self.log(f"{self.command}: stopped by {self.stopped_by.name} at step {self.step} (copy {self.copy_done}/"
                 f"{self.cfg.copy_steps}, SFT {self.sft_done}/{self.cfg.sft_steps}); checkpoint saved in {path}; "
                 f"continue with: {self.command}{flags} --out {self.cfg.out} --resume")  # fmt: skip

    def close(self) -> None:
        self.worker.close(self.pending)
        self.snapshots.close()
        if self._own_fleet:
            self.fleet.close()

    def _described_model(self) -> K3Config:
        """The model this command describes: --init's, or for a fresh policy --preset's (distillation's too)."""
        cfg = self.cfg
        return K3Config.from_pretrained(resolve_checkpoint(cfg.init)) if cfg.init else K3Config.preset(cfg.preset)

    def _check_model_config(self, ckpt: str, want: K3Config) -> None:
        """A resumed run's checkpoint must hold the model this command describes (`want`)."""
        source = f"--init {self.cfg.init}" if self.cfg.init else f"--preset {self.cfg.preset}"
        have, theirs = dataclasses.asdict(self.model.text_config), dataclasses.asdict(want.text_config)
        diff = [f"{k} {have[k]} (checkpoint) vs {theirs[k]}" for k in sorted(have) if have[k] != theirs.get(k)]
        if diff:
            raise ValueError(f"--resume: the checkpoint {ckpt} holds another model than {source}: "
                             f"{'; '.join(diff[:6])}")  # fmt: skip

    def _check_sources(self) -> None:
        """Check what the run reads besides the policy (distillation: its teachers); a named error before any work."""

    # ---- one RL step -------------------------------------------------------------------------------------------
    def _new_trajectories(self) -> list[Trajectory]:
        cfg, out = self.cfg, []
        for g in range(cfg.groups_per_step):
            group = self.task_counter
            self.task_counter += 1
            if group % self.sync.world != self.sync.rank:
                continue
            family = get_family(cfg.families[group % len(cfg.families)])
            task = family.generate("train", _task_index(cfg.seed, group))
            out += [self.worker.start(task, group=group, sample=s) for s in range(cfg.group_size)]
        return out

    def train_step(self) -> dict:
        cfg = self.cfg
        t_step = time.perf_counter()
        lr = self.rate(self.step)
        self.core.set_lr(lr)  # also when no trajectory is ready to train on
        trajs = self.pending + self._new_trajectories()
        stats = self.worker.run([t for t in trajs if not t.done], self.version, cfg.partial_rollout_fraction)
        t_rollout = time.perf_counter() - t_step
        gathered = self.sync.gather_trajectories([t for t in trajs if t.done])
        self.pending = [t for t in trajs if not t.done]
        ready, waiting, dropped = self._ready_groups(gathered)
        self.pending += [t for t in waiting if self.sync.is_local(t)]
        t0 = time.perf_counter()
        row = self.update(ready)
        t_train = time.perf_counter() - t0
        self.step += 1
        self.version += 1
        self._publish()
        t_total = time.perf_counter() - t_step
        release_freed_memory()  # the step's variable-size tensors fragment the heap (utils.release_freed_memory)
        all_stats = self.sync.gather_stats(stats)
        if not self.sync.is_main:
            return {}
        row.update(self._rollout_metrics(ready, all_stats, dropped, t_rollout, t_train, t_total))
        return {"step": self.step, "lr": lr, **row}

    def rate(self, step: int) -> float:
        """The rate of the update that makes step `step + 1`: --lr, then linear over the last --lr-decay-steps to
        --lr-min-ratio of it."""
        cfg = self.cfg
        return stable_then_decay(step, cfg.lr, cfg.lr * cfg.lr_min_ratio, cfg.steps, cfg.lr_decay_steps)

    def _ready_groups(self, finished: list[Trajectory]):
        """(trainable, waiting, dropped): a group trains once all its samples are done; too stale ones are dropped."""
        groups: dict[int, list[Trajectory]] = defaultdict(list)
        for t in finished:
            groups[t.group].append(t)
        ready, waiting, dropped = [], [], 0
        for members in groups.values():
            if len(members) < self.cfg.group_size:
                waiting += members
                continue
            versions = [v for t in members for v, g in zip(t.versions, t.generated) if g]
            oldest = min(versions, default=self.version)
            if self.version - oldest > self.cfg.max_off_policy_steps:
                dropped += len(members)
                continue
            ready += members
        return ready, waiting, dropped

    def update(self, trajs: list[Trajectory]) -> dict:
        """One optimizer step on `trajs` (complete groups, the same list on every rank); returns the loss metrics.

        Each data-parallel rank trains on its share of the trajectories, in micro-batches of whole trajectories,
        `micro_batch_tokens` each (every rank runs as many micro-batches as the busiest, padding the rest), with the
        loss divided by the whole step's totals: the accumulated, all-reduced gradient is the one-forward gradient
        while peak memory stays bounded by the micro-batch.
        """
        cfg = self.cfg
        # A trajectory that never generated (an engine error before its first token) has nothing to train on.
        trajs = [t for t in trajs if t.num_generated and t.routed_experts is not None]
        if not trajs:
            return {"loss": 0.0, "trained_sequences": 0}
        fields, adv_metrics = self.token_fields(trajs)
        lo, hi = self.sync.share(len(trajs))  # this rank's trajectories
        mine = trajs[lo:hi]
        chunks = micro_batches([len(t.tokens) for t in mine], cfg.micro_batch_tokens)
        check_other = cfg.gap_check_every > 0 and self.step % cfg.gap_check_every == 0  # steps 1, 1 + N, ...
        reference = self._kl_reference() if cfg.kl_coef > 0 else None  # every rank: its first build gathers
        batches, others = [], []
        for chunk in chunks:
            batch = [mine[i] for i in chunk]
            seqs = [t.tokens for t in batch]
            routes = [t.routed_experts for t in batch] if cfg.routing_replay else None
            per_traj = {name: [values[lo + i] for i in chunk] for name, values in fields.items()}
            per_traj["behaviour_logp_T"] = [torch.tensor(t.logprobs[1:], dtype=torch.float32) for t in batch]
            per_traj.update(self.batch_fields(batch))
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    per_traj["reference_logp_T"] = sequence_logprobs(reference, seqs, routes)
            batches.append(TokenBatch.from_sequences(seqs, [t.generated for t in batch], fields=per_traj,
                                                     routes=routes))  # fmt: skip
            if check_other:  # the gap the other way, for the report, on the pre-update weights (the engine's copy)
                with torch.no_grad():
                    other = None if cfg.routing_replay else [t.routed_experts for t in batch]
                    others.append(torch.cat(sequence_logprobs(self.engine.model, seqs, other)))
        batches += [TokenBatch.padding_batch()] * (self.sync.max_over_ranks(len(batches)) - len(batches))
        row = self.core.step(batches, self.loss_name, self.rate(self.step), self.loss_config)
        # Per token t >= 1 of each sequence, over every rank's trajectories in order (logps[i][t-1] scores token t);
        # the core gathered the update's log-probs already when its loss reports whole-step metrics.
        old_T = self.core.step_logp_T
        if old_T is None:
            (old_T,) = self.sync.gather_tensors([self.core.last_logp_T])
        other_T = self.sync.gather_tensors([torch.cat(others) if others else None])[0] if check_other else None
        mask_T = torch.tensor([g for t in trajs for g in t.generated[1:]], dtype=torch.bool)
        rollout_T = torch.tensor([lp for t in trajs for lp in t.logprobs[1:]], dtype=torch.float32)
        version_T = torch.tensor([v for t in trajs for v in t.versions[1:]])
        adv_T = torch.cat(fields["advantages_T"])
        # The gap on this version's tokens only: older segments differ by the update, not by arithmetic.
        current = mask_T & (version_T == self.version)
        ours, theirs = ("replay", "natural") if cfg.routing_replay else ("natural", "replay")
        gaps = {ours: _gap(old_T, rollout_T, current), theirs: _gap(other_T, rollout_T, current) if check_other
                else None}  # fmt: skip
        staleness = (self.version - version_T[mask_T]).float()
        return {**row, "trained_sequences": len(trajs), "micro_batches": len(chunks),
                "logprob_gap": gaps[ours], "logprob_gap_replay": gaps["replay"], "logprob_gap_natural": gaps["natural"],
                "logprob_gap_max": float((old_T - rollout_T)[current].abs().max()) if current.any() else 0.0,
                "staleness": float(staleness.mean()) if staleness.numel() else 0.0,
                "advantage_abs_mean": float(adv_T[mask_T].abs().mean()) if mask_T.any() else 0.0,
                **adv_metrics}  # fmt: skip

    def _kl_reference(self):
        """The frozen policy the KL term pulls towards: the weights at the start of RL, so after the warm start (a
        copy made before it would be the untrained model). The first update saves it to `out/reference` (a release
        folder, written whole then renamed) and a resumed run loads it from there, not from its resumed weights."""
        if self.reference is None:
            path = os.path.join(self.cfg.out, REFERENCE)
            if os.path.exists(path):
                self.reference, _ = load_model(path, dtype=torch.float32)
            else:
                if self.step > 0:
                    raise FileNotFoundError(f"{path} is missing: the KL reference of a run past step 0 (the policy "
                                            f"at its RL start) cannot be rebuilt; start a new run for --kl-coef")  # fmt: skip
                self.reference = self._policy_copy()
                if self.sync.is_main:
                    tmp = path + ".tmp"
                    self.reference.save_pretrained(tmp)
                    os.replace(tmp, path)
            self.reference.eval().requires_grad_(False)
        return self.reference

    def _policy_copy(self):
        """A whole, plain copy of the (laid-out) policy on this rank, without gradients."""
        if self.sync.world == 1:
            copied = copy.deepcopy(self.model)
            for param in copied.parameters():
                param.grad = None
            return copied
        copied = build_model(self.model.config, self.layout.device)
        target = copied.state_dict()
        with torch.no_grad():
            for name, full in self.sync.full_tensors(self.model):
                target[name].copy_(full)
        return copied

    @property
    def step_episodes(self) -> int:
        """Episodes a training step has in flight at once (the engine and the fleet are sized for it)."""
        return self.cfg.groups_per_step * self.cfg.group_size

    @property
    def eval_episodes(self) -> int:
        """Episodes of one held-out evaluation (all in flight at once: the engine and the fleet are sized for it)."""
        return self.cfg.eval_tasks * len(self.cfg.families)

    @property
    def loss_name(self) -> str:
        """The registered loss the update trains with (train/losses.py)."""
        return self.cfg.loss

    def token_fields(self, trajs: list[Trajectory]) -> tuple[dict[str, list[torch.Tensor]], dict]:
        """(per-token fields per trajectory, metrics): GRPO's group advantage of each trajectory's reward, on all its
        positions (the loss reads the mask positions only). Distillation adds its teacher fields (rl/distill.py)."""
        rewards_S = torch.tensor([t.reward for t in trajs])
        groups_S = torch.tensor([t.group for t in trajs])
        adv_S = group_advantages(rewards_S, groups_S, normalize_std=self.cfg.normalize_std)
        return {"advantages_T": [adv_S[i].expand(len(t.tokens) - 1) for i, t in enumerate(trajs)]}, {}

    def batch_fields(self, batch: list[Trajectory]) -> dict[str, list[torch.Tensor]]:
        """More per-token fields of one micro-batch's trajectories, scored with it (distillation's top-k target)."""
        return {}

    def _fresh_policy(self):
        """(model, tokenizer) of a run without --init: a fresh `preset` model and a tokenizer trained for the tasks."""
        return fresh_policy(self.cfg.preset, self.cfg.families, self.cfg.seed)

    def _publish(self, force: bool = False) -> None:
        """Copy the trainer's weights into the engine(s) when they would fall too far behind."""
        if force or self.version - self.engine.weight_version > self.cfg.max_off_policy_steps:
            self.sync.publish(self.model, self.engine, self.version)

    def _rollout_metrics(self, trajs, stats: RolloutStats, dropped: int, t_rollout, t_train, t_total) -> dict:
        success = defaultdict(list)
        for t in trajs:
            success[t.task.family].append(float(t.reward >= SUCCESS))
        n = max(len(trajs), 1)
        return {
            "reward": sum(t.reward for t in trajs) / n,
            "success": {f: sum(v) / len(v) for f, v in sorted(success.items())},
            "response_tokens": sum(t.num_generated for t in trajs) / n,
            "turns": sum(t.turns for t in trajs) / n,
            "tool_calls": sum(t.tool_calls for t in trajs) / n,
            "tool_errors": sum(t.tool_errors for t in trajs) / n,
            "rollout_tokens_per_s": stats.generated_tokens / max(stats.wall_s, 1e-9),
            "prefill_tokens_per_episode": sum(t.prefill_tokens for t in trajs) / n,
            "prompt_tokens_per_episode": sum(t.prompt_tokens for t in trajs) / n,
            "inference_share": stats.inference_s / t_total,
            "sandbox_share": stats.sandbox_s / t_total,
            "train_share": t_train / t_total,
            "step_s": t_total,
            "rollout_s": t_rollout,
            "dropped_stale": dropped,
            "aborted": stats.aborted,
            "pending": len(self.pending),
            "routing_replay": self.cfg.routing_replay,
            "version": self.version,
        }

    # ---- evaluation --------------------------------------------------------------------------------------------
    @property
    def eval_keys(self) -> list[TeacherKey]:
        """What the held-out evaluation scores separately: each task family."""
        return [TeacherKey(name, None) for name in self.cfg.families]

    def held_out_episodes(self) -> dict:
        """{key: this rank's share of the held-out evaluation, run}: greedy episodes on the test split's first
        `eval_tasks` tasks per key (the same tasks every time)."""
        return held_out_episodes(self.worker, self.eval_keys, self.cfg.eval_tasks, version=self.version,
                                 rank=self.sync.rank, world=self.sync.world)  # fmt: skip

    def evaluate(self, episodes: dict | None = None) -> dict:
        """Held-out success per key, over `episodes` (ones `held_out_episodes` ran, for a caller that also reads
        them: the RL benchmark) or a fresh run of them."""
        trajs = self.held_out_episodes() if episodes is None else episodes
        summary = summarize(self.sync.gather_results(episode_results(trajs)))
        return {"eval_success": {k: v["success"] for k, v in sorted(summary.items())}}

    # ---- files -------------------------------------------------------------------------------------------------
    def _write(self, row: dict, metrics_file: str = "metrics.jsonl") -> dict:
        if self.sync.is_main and row:
            os.makedirs(self.cfg.out, exist_ok=True)
            with open(os.path.join(self.cfg.out, metrics_file), "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            if "eval_success" in row:
                shown = ", ".join(f"{k} {v:.0%}" for k, v in row["eval_success"].items())
                self.log(f"{self.command}: step {row.get('step', 0)}: held-out success {shown}")
        return row

    def save(self) -> str:
        """An atomic checkpoint in the training format (weights, optimizer moments, RNG, the loop's counters) at this
        layout: every rank writes its shards; it resumes at any layout and `k3 export` reads it."""
        state = {"version": self.version, "sft_done": self.sft_done, "copy_done": self.copy_done,
                 "task_counter": self.task_counter, "demos": self.demos.state_dict(),
                 "copies": self.copies.state_dict(), **self._extra_state()}  # fmt: skip
        return self.core.save(self.cfg.out, self.step, state, tokenizer=self.tokenizer, keep=self.cfg.keep_checkpoints)

    def _extra_state(self) -> dict:
        """More loop state for the checkpoint (a subclass's); JSON-able."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    def _checkpoint_to_resume(self) -> str | None:
        cfg = self.cfg
        has_run = any(
            os.path.exists(os.path.join(cfg.out, name)) for name in ("metrics.jsonl", "sft.jsonl", CHECKPOINTS)
        )
        if not cfg.resume:
            if has_run:
                raise FileExistsError(f"{cfg.out} already holds an RL run: pass --resume to continue it, or another "
                                      f"--out")  # fmt: skip
            return None
        ckpt = latest_checkpoint(cfg.out)
        if ckpt is None:
            self.log(f"{self.command}: {cfg.out} has no complete checkpoint; starting from step 0")
            if self.sync.is_main:  # the one process that writes the run's files
                truncate_metrics(os.path.join(cfg.out, "metrics.jsonl"), -1)
        return ckpt

    def _load_state(self, ckpt: str) -> None:
        state = self.core.load(ckpt)
        # The command's --lr / --weight-decay win; a decaying rate is set every step, so its change is no news.
        changed = describe_changes(state[OPTIMIZER_CHANGES], skip=("lr",) if self.cfg.lr_decay_steps else ())
        if changed:
            self.log(f"{self.command}: this run's optimizer settings replace the checkpoint's: {changed}")
        self.step, self.version, self.sft_done = state["step"], state["version"], state["sft_done"]
        self.task_counter = state["task_counter"]
        self.demos.load_state_dict(state["demos"])
        self.copy_done = state.get("copy_done", 0)  # runs saved before the copy phase existed have none
        if "copies" in state:
            self.copies.load_state_dict(state["copies"])
        self._load_extra_state(state)
        if self.sync.is_main:  # several ranks rewriting it through one temporary file would race
            truncate_metrics(os.path.join(self.cfg.out, "metrics.jsonl"), self.step)
        self.log(f"{self.command}: resumed {self.cfg.out} at step {self.step} from {ckpt}")
        if self.cfg.lr_decay_steps:
            self.log(f"{self.command}: the rate of the next update is {self.rate(self.step):.3g} (--lr {self.cfg.lr:g}, "
                     f"decaying over steps {self.cfg.steps - self.cfg.lr_decay_steps + 1}-{self.cfg.steps})")  # fmt: skip


def _task_index(seed: int, group: int) -> int:
    """The training task of group `group`: a fixed function of the seed, so ranks and resumes agree."""
    return random.Random(seed * 1_000_003 + group).randrange(2**31)


def _gap(a_T: torch.Tensor, b_T: torch.Tensor, mask_T: torch.Tensor) -> float:
    """Mean |a - b| over the masked tokens (0 when none)."""
    return float((a_T - b_T)[mask_T].abs().mean()) if mask_T.any() else 0.0
