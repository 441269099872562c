"""Trainer <-> rollout workers: publishing weights into engines, gathering trajectories, across processes or not.

One process: `Sync.single()`; publishing copies the trainer's tensors into the engine's model in place
(`LLMEngine.update_weights`, which bumps the engine's version and invalidates its prefix cache).

N processes (a torch.distributed group, gloo on CPU): every rank runs rollouts with its own engine; rank 0 alone
trains. Trajectories and per-rank statistics go to rank 0 with `all_gather_object` (in rank order, so the update's
batch is the same every run); the new weights go from rank 0 to every rank with one `broadcast` per tensor, into a
buffer copy of the model's state that each rank then loads into its engine. Every rank's engine therefore serves
exactly rank 0's weights (tested bitwise).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from openk3.rl.rollout import RolloutStats, Trajectory


class Sync:
    def __init__(self, rank: int = 0, world: int = 1, group=None):
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def single(cls) -> Sync:
        return cls()

    @classmethod
    def from_process_group(cls, group=None) -> Sync:
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def is_local(self, traj: Trajectory) -> bool:
        """Whether this rank owns `traj` (its group's rollouts run here)."""
        return traj.group % self.world == self.rank

    def _gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_trajectories(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Every rank's finished trajectories, rank by rank (their live environments are not sent)."""
        if self.world == 1:
            return trajs
        sendable = [dataclasses.replace(t, env=None) for t in trajs]
        return [t for part in self._gather(sendable) for t in part]

    def gather_stats(self, stats: RolloutStats) -> RolloutStats:
        """The ranks' rollout statistics: counts summed, times of the slowest rank (they ran side by side)."""
        if self.world == 1:
            return stats
        parts = self._gather(stats)
        total = parts[0]
        for p in parts[1:]:
            total = total.merge(p)
        for name in ("inference_s", "sandbox_s", "wall_s"):
            setattr(total, name, max(getattr(p, name) for p in parts))
        return total

    def gather_results(self, results: list) -> list:
        return [r for part in self._gather(results) for r in part]

    def average_gradients(self, model: torch.nn.Module) -> None:
        """Data-parallel SFT: every rank's gradient replaced by the mean over ranks."""
        if self.world == 1:
            return
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)
                p.grad /= self.world

    def publish(self, model: torch.nn.Module, engine, version: int) -> None:
        """Rank 0's `model` weights into every rank's `engine`, tagged `version`."""
        state = {name: t.detach() for name, t in model.state_dict().items()}
        if self.world > 1:
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for name in sorted(state):
                buf = state[name].clone() if self.is_main else torch.empty_like(state[name])
                dist.broadcast(buf, src=src, group=self.group)
                state[name] = buf
            if not self.is_main:  # the trainer copies stay equal too (SFT steps and the next update read them)
                with torch.no_grad():
                    for name, t in model.state_dict().items():
                        t.copy_(state[name])
        engine.update_weights(state, version)
