"""The RL loop behind `k3 rl`: rollout -> advantages -> update -> publish, on one process or many.

Per step:
    1. rollout: `groups_per_step` tasks (round-robin over the families), `group_size` samples each, plus the
       trajectories a partial-rollout cut left unfinished, generated on the serving engine (`RolloutWorker.run`);
    2. the trajectories whose whole group is done are trained on; one with tokens older than `max_off_policy_steps`
       versions is dropped (bounded staleness), the rest wait for the next step;
    3. advantages: reward minus the group mean (GRPO); the update: one packed forward of the trainer model with the
       rollout's routed experts (routing replay) or its own routes, the policy loss (`losses.policy_loss`) against
       the rollout's behaviour log-probs, AdamW;
    4. publish: the new weights are copied into the engine in place (`LLMEngine.update_weights`, which invalidates
       its prefix cache by version) once the engine's weights would otherwise be more than `max_off_policy_steps`
       versions behind;
    5. one line in metrics.jsonl; held-out evaluation (greedy) every `eval_every` steps; atomic checkpoints.

Across processes (`k3 rl --nproc N`, gloo or NCCL under torchrun): every rank is a rollout worker with its own engine
and sandbox fleet and takes every N-th group; rank 0 gathers the trajectories (`all_gather_object`), makes the update
on all of them (so N ranks give exactly the one-process update of the same trajectories) and broadcasts the new
weights to every rank's engine (`weight_sync.broadcast_weights`).

Measured per step: reward; success per family (reward 1); response length; turns; tool calls; rollout tokens/s;
the time shares of inference, sandboxes and training; staleness (trained version minus the version of each token);
the clip fraction; the rollout-vs-train log-prob gap of this version's tokens (`logprob_gap`: with routing replay
when it is on) and, on step 1 and every `gap_check_every` steps, the gap the other way (then `logprob_gap_replay`
and `logprob_gap_natural` both; one extra forward, so not every step).
"""

from __future__ import annotations

import copy
import json
import os
import random
import time
from collections import defaultdict

import torch

from openk3.config import K3Config
from openk3.data.tokenizer import load_tokenizer
from openk3.data.xtml import require_markers
from openk3.rl.config import RLConfig
from openk3.rl.env import Budgets, TaskSnapshots
from openk3.rl.envs import get_family
from openk3.rl.logprobs import sequence_logprobs
from openk3.rl.losses import LossConfig, group_advantages, policy_loss
from openk3.rl.rollout import RolloutStats, RolloutWorker, Trajectory
from openk3.rl.sft import COPY_BATCH, CopyStream, DemoStream, fresh_policy, sft_loss
from openk3.rl.weight_sync import Sync
from openk3.serve.config import CheckpointPolicy, ServeConfig
from openk3.serve.engine import LLMEngine
from openk3.train.balance import Balancer
from openk3.train.checkpoint import (
    OPTIMIZER_CHANGES,
    build_model,
    describe_changes,
    latest_checkpoint,
    load_checkpoint,
    load_model,
    save_checkpoint,
)
from openk3.train.distributed import Layout
from openk3.train.optim import param_groups, stable_then_decay
from openk3.utils import release_freed_memory

SUCCESS = 1.0  # a reward of 1 is a solved task
REFERENCE = "reference"  # the run's KL reference (the policy at the start of RL), a release-format folder


def engine_config(cfg: RLConfig, max_seqs: int) -> ServeConfig:
    """The rollout engine: routes recorded, small hash units so each turn resumes from the previous one."""
    return ServeConfig(max_model_len=2048, max_num_seqs=max_seqs, max_num_batched_tokens=4096,
                       enable_prefix_caching=cfg.prefix_caching, hash_unit=8, block_size=64,
                       checkpoint_policy=CheckpointPolicy(output_end=True), record_routed_experts=True,
                       cache_memory_bytes=256 * 2**20)  # fmt: skip


class RLTrainer:
    command = "k3 rl"  # how log lines name the run

    def __init__(self, cfg: RLConfig, log=print, sync: Sync | None = None, fleet=None):
        self.cfg, self.sync = cfg, sync or Sync.single()
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
        self.model.train()
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
        # The router biases stay as they are during RL (no balancing); the Balancer only carries the checkpoint
        # format's balancing state, so `k3 generate/serve/export --ckpt RUN` read RL runs like training runs.
        self.balancer = Balancer(self.model, "none")
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
        if ckpt is not None:
            self._load_state(ckpt)
        engine_model = copy.deepcopy(self.model).eval().requires_grad_(False)
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
        cfg = self.cfg
        if self.copy_done < cfg.copy_steps or self.sft_done < cfg.sft_steps:
            self.warm_start()
        last: dict = {}
        if self.step == 0:
            last = self._write({"step": 0, **self.evaluate()})
        end = cfg.steps if cfg.stop_after is None else min(cfg.steps, self.step + cfg.stop_after)
        bar = _progress(end, self.step, cfg.progress and self.sync.is_main, "rl")
        try:
            while self.step < end:
                row = self.train_step()
                if self.step % cfg.eval_every == 0 or self.step == end:
                    row.update(self.evaluate())
                last = self._write(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.2f}", gap=f"{row['logprob_gap']:.1e}")
                if self.step % cfg.save_every == 0 or self.step == end:
                    self.save()
        finally:
            bar.close()
        return last

    def close(self) -> None:
        self.worker.close(self.pending)
        self.snapshots.close()
        if self._own_fleet:
            self.fleet.close()

    # ---- SFT warm start ----------------------------------------------------------------------------------------
    def warm_start(self) -> None:
        """Copy pre-training (`copy_steps`, for a fresh policy: sft.CopyStream), then SFT on demonstrations
        (`sft_steps`), one AdamW; each phase's progress is counted, so a resumed run skips what is done."""
        cfg = self.cfg
        optimizer = torch.optim.AdamW(param_groups(self.model, 0.0), lr=cfg.sft_lr, betas=(0.9, 0.95))
        t0 = time.perf_counter()
        # Constant rate for the copy phase: the induction phase change needs the full rate (sft.py).
        self.copy_done = self._supervised("copy", self.copy_done, cfg.copy_steps, lambda: self.copies.batch(COPY_BATCH),
                                          optimizer, lambda f: 1.0)  # fmt: skip
        # Linear decay to a tenth: the last steps settle the policy RL starts from.
        self.sft_done = self._supervised("sft", self.sft_done, cfg.sft_steps,
                                         lambda: self.demos.batch(cfg.sft_batch_size), optimizer, lambda f: 1 - 0.9 * f)  # fmt: skip
        release_freed_memory()
        self._publish(force=True)
        self.log(f"{self.command}: warm start: {cfg.copy_steps} copy + {cfg.sft_steps} SFT steps in "
                 f"{time.perf_counter() - t0:.0f} s")  # fmt: skip

    def _supervised(self, phase: str, done: int, total: int, batch, optimizer, schedule) -> int:
        """Steps of `phase` ("copy" or "sft") from `done` up to `total`: cross-entropy on each batch's masked tokens,
        the rate `sft_lr * schedule(done / total)`; a line in sft.jsonl every 20 steps and at the end. Returns the
        steps done."""
        cfg = self.cfg
        bar = _progress(total, done, cfg.progress and self.sync.is_main, phase)
        t0 = time.perf_counter()
        while done < total:
            for group in optimizer.param_groups:
                group["lr"] = cfg.sft_lr * schedule(done / total)
            loss, n = sft_loss(self.model, batch())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.sync.average_gradients(self.model)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
            optimizer.step()
            done += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if done % 20 == 0 or done == total:
                self._write({f"{phase}_step": done, f"{phase}_loss": loss.item(), f"{phase}_tokens": n,
                             "elapsed_s": time.perf_counter() - t0}, metrics_file="sft.jsonl")  # fmt: skip
        bar.close()
        return done

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
        lr = self._set_rate()
        trajs = self.pending + self._new_trajectories()
        stats = self.worker.run([t for t in trajs if not t.done], self.version, cfg.partial_rollout_fraction)
        t_rollout = time.perf_counter() - t_step
        gathered = self.sync.gather_trajectories([t for t in trajs if t.done])
        self.pending = [t for t in trajs if not t.done]
        ready, waiting, dropped = self._ready_groups(gathered)
        self.pending += [t for t in waiting if self.sync.is_local(t)]
        t0 = time.perf_counter()
        row = self.update(ready) if self.sync.is_main else {}
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

    def _set_rate(self) -> float:
        lr = self.rate(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

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
        """One optimizer step on `trajs` (complete groups); returns the loss metrics.

        The forward/backward runs in micro-batches of whole trajectories, `micro_batch_tokens` each, with the loss
        divided by the whole batch's totals (`policy_loss(normalizers=...)`), so the accumulated gradient is the
        one-forward gradient while peak memory stays bounded by the micro-batch.
        """
        cfg = self.cfg
        # A trajectory that never generated (an engine error before its first token) has nothing to train on.
        trajs = [t for t in trajs if t.num_generated and t.routed_experts is not None]
        if not trajs:
            return {"loss": 0.0, "trained_sequences": 0}
        # Per token t >= 1 of each sequence (logps[i][t-1] scores token t).
        mask_T = torch.tensor([g for t in trajs for g in t.generated[1:]], dtype=torch.bool)
        rollout_T = torch.tensor([lp for t in trajs for lp in t.logprobs[1:]], dtype=torch.float32)
        version_T = torch.tensor([v for t in trajs for v in t.versions[1:]])
        seq_T = torch.cat([torch.full((len(t.tokens) - 1,), i) for i, t in enumerate(trajs)])
        adv_T, adv_metrics = self.token_advantages(trajs, seq_T, mask_T)
        normalizers = (int(mask_T.sum()), sum(any(t.generated[1:]) for t in trajs))
        offsets = [0]  # trajectory i's tokens are [offsets[i], offsets[i + 1]) of the packed tensors
        for t in trajs:
            offsets.append(offsets[-1] + len(t.tokens) - 1)
        self.optimizer.zero_grad(set_to_none=True)
        logps, others, refs = [], [], []
        check_other = cfg.gap_check_every > 0 and self.step % cfg.gap_check_every == 0  # steps 1, 1 + N, ...
        chunks = micro_batches([len(t.tokens) for t in trajs], cfg.micro_batch_tokens)
        for chunk in chunks:
            batch = [trajs[i] for i in chunk]
            lo, hi = offsets[chunk[0]], offsets[chunk[-1] + 1]  # chunks are consecutive runs of trajectories
            seqs = [t.tokens for t in batch]
            routes = [t.routed_experts for t in batch] if cfg.routing_replay else None
            logp_T = torch.cat(sequence_logprobs(self.model, seqs, routes))
            ref_T = None
            if cfg.kl_coef > 0:
                with torch.no_grad():
                    ref_T = torch.cat(sequence_logprobs(self._kl_reference(), seqs, routes))
                refs.append(ref_T)
            loss, _ = policy_loss(logp_T, logp_T.detach(), adv_T[lo:hi], mask_T[lo:hi], seq_T[lo:hi] - chunk[0],
                                  self.loss_config, rollout_logp_T=rollout_T[lo:hi], ref_logp_T=ref_T,
                                  normalizers=normalizers)  # fmt: skip
            loss.backward()
            if check_other:  # the gap the other way, for the report, on the pre-update weights (the engine's copy)
                with torch.no_grad():
                    other = None if cfg.routing_replay else [t.routed_experts for t in batch]
                    others.append(torch.cat(sequence_logprobs(self.engine.model, seqs, other)))
            logps.append(logp_T.detach())
            del logp_T, loss
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        old_T = torch.cat(logps)
        # The metrics (loss, clip and IcePop fractions, ...) over the whole batch at once, from the detached values.
        _, metrics = policy_loss(old_T, old_T, adv_T, mask_T, seq_T, self.loss_config, rollout_logp_T=rollout_T,
                                 ref_logp_T=torch.cat(refs) if refs else None)  # fmt: skip
        # The gap on this version's tokens only: older segments differ by the update, not by arithmetic.
        current = mask_T & (version_T == self.version)
        ours, theirs = ("replay", "natural") if cfg.routing_replay else ("natural", "replay")
        gaps = {ours: _gap(old_T, rollout_T, current), theirs: _gap(torch.cat(others), rollout_T, current) if others
                else None}  # fmt: skip
        staleness = (self.version - version_T[mask_T]).float()
        return {**metrics, "grad_norm": float(grad_norm), "trained_sequences": len(trajs),
                "micro_batches": len(chunks),
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
                self.reference = copy.deepcopy(self.model)
                for param in self.reference.parameters():
                    param.grad = None
                if self.sync.is_main:
                    tmp = path + ".tmp"
                    self.reference.save_pretrained(tmp)
                    os.replace(tmp, path)
            self.reference.eval().requires_grad_(False)
        return self.reference

    @property
    def step_episodes(self) -> int:
        """Episodes a training step has in flight at once (the engine and the fleet are sized for it)."""
        return self.cfg.groups_per_step * self.cfg.group_size

    @property
    def eval_episodes(self) -> int:
        """Episodes of one held-out evaluation (all in flight at once: the engine and the fleet are sized for it)."""
        return self.cfg.eval_tasks * len(self.cfg.families)

    def token_advantages(self, trajs: list[Trajectory], seq_T: torch.Tensor, mask_T: torch.Tensor):
        """(advantage per packed token, metrics): GRPO's group advantage of each trajectory's reward, on all its
        tokens (the loss reads the mask tokens only). Distillation adds its per-token rewards here (rl/distill.py)."""
        rewards_S = torch.tensor([t.reward for t in trajs])
        groups_S = torch.tensor([t.group for t in trajs])
        adv_S = group_advantages(rewards_S, groups_S, normalize_std=self.cfg.normalize_std)
        return adv_S[seq_T], {}

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
    def held_out_episodes(self) -> list[Trajectory]:
        """This rank's share of the held-out evaluation, run: greedy episodes on the test split's first `eval_tasks`
        tasks per family (the same tasks every time)."""
        cfg = self.cfg
        trajs = []
        for name in cfg.families:
            family = get_family(name)
            for i in range(self.sync.rank, cfg.eval_tasks, self.sync.world):
                trajs.append(self.worker.start(family.generate("test", i), group=-1, sample=i))
        self.worker.run(trajs, self.version, temperature=0.0)
        return trajs

    def evaluate(self, episodes: list[Trajectory] | None = None) -> dict:
        """Held-out success per family, over `episodes` (ones `held_out_episodes` ran, for a caller that also reads
        them: the RL benchmark) or a fresh run of them."""
        trajs = self.held_out_episodes() if episodes is None else episodes
        results = self.sync.gather_results([(t.task.family, t.reward) for t in trajs])
        by_family = defaultdict(list)
        for family, reward in results:
            by_family[family].append(float(reward >= SUCCESS))
        return {"eval_success": {f: sum(v) / len(v) for f, v in sorted(by_family.items())}}

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

    def save(self) -> str | None:
        """An atomic checkpoint (the training format: weights, AdamW moments, RNG, the loop's counters), written by
        rank 0 alone: it holds the trained weights, which every rank's copy equals."""
        if not self.sync.is_main:
            return None
        state = {"version": self.version, "sft_done": self.sft_done, "copy_done": self.copy_done,
                 "task_counter": self.task_counter, "demos": self.demos.state_dict(),
                 "copies": self.copies.state_dict(), "nonfinite_total": 0, "tokens_seen": 0,
                 **self._extra_state()}  # fmt: skip
        return save_checkpoint(self.cfg.out, self.step, self.model, self.optimizer, self.balancer.state_dict(), state,
                               tokenizer=self.tokenizer, keep=self.cfg.keep_checkpoints, layout=Layout.single())  # fmt: skip

    def _extra_state(self) -> dict:
        """More loop state for the checkpoint (a subclass's); JSON-able."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        pass

    def _checkpoint_to_resume(self) -> str | None:
        cfg = self.cfg
        has_run = os.path.exists(os.path.join(cfg.out, "metrics.jsonl"))
        if not cfg.resume:
            if has_run:
                raise FileExistsError(f"{cfg.out} already holds an RL run: pass --resume to continue it, or another "
                                      f"--out")  # fmt: skip
            return None
        ckpt = latest_checkpoint(cfg.out)
        if ckpt is None:
            self.log(f"{self.command}: {cfg.out} has no complete checkpoint; starting from step 0")
            _truncate_metrics(os.path.join(cfg.out, "metrics.jsonl"), -1)
        return ckpt

    def _load_state(self, ckpt: str) -> None:
        state = load_checkpoint(ckpt, self.model, self.optimizer, self.balancer, Layout.single())
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
        _truncate_metrics(os.path.join(self.cfg.out, "metrics.jsonl"), self.step)
        self.log(f"{self.command}: resumed {self.cfg.out} at step {self.step} from {ckpt}")
        if self.cfg.lr_decay_steps:
            self.log(f"{self.command}: the rate of the next update is {self.rate(self.step):.3g} (--lr {self.cfg.lr:g}, "
                     f"decaying over steps {self.cfg.steps - self.cfg.lr_decay_steps + 1}-{self.cfg.steps})")  # fmt: skip


def _task_index(seed: int, group: int) -> int:
    """The training task of group `group`: a fixed function of the seed, so ranks and resumes agree."""
    return random.Random(seed * 1_000_003 + group).randrange(2**31)


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive index runs of `lengths` whose sums stay within `max_tokens` (a longer sequence is alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if not out or total + n > max_tokens:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _gap(a_T: torch.Tensor, b_T: torch.Tensor, mask_T: torch.Tensor) -> float:
    """Mean |a - b| over the masked tokens (0 when none)."""
    return float((a_T - b_T)[mask_T].abs().mean()) if mask_T.any() else 0.0


def _truncate_metrics(path: str, step: int) -> None:
    """Drop metric lines past `step` (a resumed run repeats them)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if json.loads(line).get("step", 0) <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from openk3.train.trainer import _progress as train_progress

    bar = train_progress(total, initial, enabled)
    if enabled:
        bar.set_description(desc)
    return bar
