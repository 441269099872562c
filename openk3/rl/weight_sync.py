"""Trainer <-> rollout workers across processes: gathering trajectories, sharing the update, publishing weights.

One process is a world of 1 (`Sync(Layout.single())`): nothing is sent, and publishing copies the trainer's
tensors into the engine's model in place (`LLMEngine.update_weights`, which bumps the engine's version and
invalidates its prefix cache).

N processes (a torch.distributed group, gloo on CPU, NCCL on CUDA), laid out dp x ep x cp like `k3 train`: every
rank runs rollouts with its own engine (a whole copy of the policy) and trains on its data rank's share of the step's
trajectories with the sharded policy (the cp ranks of a data rank each take a piece of its packed positions).
Finished trajectories and per-rank statistics go to every rank with `all_gather_object` (in rank order, so every
rank forms the same batch and the same advantages); data rank r trains on `share(n)`. The new
weights reach every engine from the sharded parameters one tensor at a time (an FSDP2 shard gathered with
`full_tensor`, EP experts with an all-gather over the ep group) and are copied into the engine's tensor before the
next is gathered: no rank holds the whole model beyond its engine's copy.

Legend: T packed positions.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from openk3.rl.rollout import RolloutStats, Trajectory
from openk3.train.distributed import Layout


class Sync:
    def __init__(self, layout: Layout):
        self.layout = layout
        self.rank, self.world = layout.rank, layout.world

    @classmethod
    def single(cls) -> Sync:
        return cls(Layout.single())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def is_local(self, traj: Trajectory) -> bool:
        """Whether this rank owns `traj` (its group's rollouts run here)."""
        return traj.group % self.world == self.rank

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi): this rank's consecutive share of n items (sizes differ by at most one)."""
        r, w = self.layout.data_rank, self.layout.dims.data_ranks
        return r * n // w, (r + 1) * n // w

    def max_over_ranks(self, n: int) -> int:
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def any_rank(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank (one tiny all-reduce)."""
        return self.max_over_ranks(int(flag)) > 0

    def _gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_trajectories(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Every rank's finished trajectories, rank by rank (their live environments are not sent)."""
        if self.world == 1:
            return trajs
        sendable = [dataclasses.replace(t, env=None) for t in trajs]
        return [t for part in self._gather(sendable) for t in part]

    def gather_tensors(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Each of this data rank's per-token `tensors` (on its `share` of the trajectories) concatenated over the
        data ranks in order (None where every rank sent None); the cp ranks of a data rank hold the same tensors,
        and its first sends them."""
        if self.world == 1:
            return tensors
        mine = [None if t is None else t.detach().cpu() for t in tensors] if self.layout.is_data_leader else None
        parts = [p for p in self._gather(mine) if p is not None]
        out = []
        for i in range(len(tensors)):
            given = [p[i] for p in parts if p[i] is not None]  # a rank with no trajectories sends None
            out.append(torch.cat(given) if given else None)
        return out

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

    def full_tensors(self, model: torch.nn.Module):
        """(name, whole tensor) of the laid-out `model`'s state, one at a time; every rank must iterate all of it."""
        return self.layout.full_tensors(model)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, engine, version: int) -> None:
        """The trainer's `model` (laid out) into this rank's `engine`, tagged `version`."""
        if self.world == 1:
            engine.update_weights({name: t.detach() for name, t in model.state_dict().items()}, version)
            return
        target = engine.model.state_dict()
        for name, full in self.full_tensors(model):
            target[name].copy_(full)
            del full
        engine.update_weights(target, version)
