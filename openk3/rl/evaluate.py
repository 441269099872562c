"""Held-out evaluation of a policy: the one evaluation behind `k3 rl`, `k3 distill` and the benchmarks.

Episodes on the `split`'s tasks `first` .. `first + tasks - 1` of each key (a task family, with an effort for
distillation keys), `samples` per task, greedy by default, all in flight at once on one rollout worker. Sample s of
task i is sample number i * samples + s (the rollout's per-trajectory seed), so one sample per task keeps the seeds
of a plain evaluation and two models are compared on the same seeds. `tagged` renders the effort tag in the prompt
(the student's view); untagged, an effort key keeps only its think channel (a teacher's). On several ranks each rank
runs every world-th task and `summarize` reads every rank's results.
"""

from __future__ import annotations

from collections import defaultdict

from openk3.rl.envs import get_family
from openk3.rl.rollout import RolloutWorker

SUCCESS = 1.0  # a reward of 1 is a solved task


def held_out_episodes(worker: RolloutWorker, keys: list, tasks: int, *, tagged: bool = True, first: int = 0,
                      samples: int = 1, temperature: float = 0.0, split: str = "test", version: int = 0,
                      rank: int = 0, world: int = 1) -> dict:  # fmt: skip
    """{key: this rank's finished trajectories of the key's tasks, in task order}. `keys`: TeacherKeys (a domain and
    an effort or None)."""
    check_selection(first, samples)
    trajs = {}
    for key in keys:
        family = get_family(key.domain)
        trajs[key] = [worker.start(family.generate(split, i), group=-1, sample=i * samples + s, thinking=key.thinking,
                                   effort=key.effort if tagged else None)
                      for i in range(first + rank, first + tasks, world) for s in range(samples)]  # fmt: skip
    worker.run([t for v in trajs.values() for t in v], version, temperature=temperature)
    return trajs


def check_selection(first: int, samples: int) -> None:
    if first < 0:
        raise ValueError(f"first must be >= 0 (a task index), got {first}")
    if samples < 1:
        raise ValueError(f"samples must be >= 1 (episodes per task), got {samples}")


def episode_results(trajs: dict) -> list[tuple[str, float, int, str | None]]:
    """(key name, reward, generated tokens, end reason) of every episode of {key: trajectories}: what ranks
    exchange."""
    return [(str(key), t.reward, t.num_generated, t.reason) for key, v in trajs.items() for t in v]


def summarize(results: list[tuple[str, float, int, str | None]]) -> dict[str, dict]:
    """Per key name: held-out success, mean response length (generated tokens) and the episodes the wall clock cut
    (`wall_clock_cut`, counted as failures)."""
    by_key = defaultdict(list)
    for name, reward, length, reason in results:
        by_key[name].append((reward, length, reason))
    return {name: {"success": sum(r >= SUCCESS for r, _, _ in v) / len(v), "length": sum(n for _, n, _ in v) / len(v),
                   "wall_clock_cut": sum(reason == "wall_clock" for _, _, reason in v)}
            for name, v in by_key.items()}  # fmt: skip

