"""Held-out evaluation of a policy: the one evaluation behind `k3 rl`, `k3 distill` and the benchmarks.

Episodes on the `split`'s tasks `first` .. `first + tasks - 1` of each key (a task family, with an effort for
distillation keys), `samples` per task, greedy by default, all in flight at once on one rollout worker. Sample s of
task i is sample number i * samples + s (the rollout's per-trajectory seed), so one sample per task keeps the seeds
of a plain evaluation and two models are compared on the same seeds. `tagged` renders the effort tag in the prompt
(the student's view); untagged, an effort key keeps only its think channel (a teacher's). On several ranks each rank
runs every world-th task and `summarize` reads every rank's results.
"""

from __future__ import annotations

import math
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


def policy_episodes(model, tokenizer, keys: list, tasks: int, fleet, *, tagged: bool,
                    max_turns: int = 4, max_tokens: int = 256, max_tokens_per_turn: int = 128,
                    temperature: float = 0.0, wall_clock_s: float = math.inf, first: int = 0,
                    split: str = "test", samples: int = 1) -> dict:  # fmt: skip
    """{key: the finished trajectories of the `split`'s tasks `first` .. `first + tasks - 1`, `samples` per task in
    task order} of `model` on its own engine (a checkpoint outside a training run: the distillation benchmark's
    teachers, students and cold start): `held_out_episodes` (which says what the options mean).
    `first` > 0 gives a second held-out set, one no checkpoint was chosen on; `split` "train" gives training tasks
    (what a teacher generates for offpolicy distillation).

    No wall clock by default: the turn and token budgets bound every episode (and each tool call keeps its own
    timeout), and all episodes share one batched engine, so an episode's time since reset is the whole batch's and
    depends on the machine's load (with 600 s, an evaluation run beside training scored 5% where the same checkpoint
    scores 55% alone, most likely so). `evaluate_policy` counts the episodes a finite `wall_clock_s` cut."""
    from openk3.rl.config import RLConfig
    from openk3.rl.env import Budgets, TaskSnapshots
    from openk3.rl.loop import engine_config
    from openk3.rl.rollout import RolloutWorker
    from openk3.serve.engine import LLMEngine

    check_selection(first, samples)
    episodes = tasks * samples * len(keys)
    engine = LLMEngine(model, tokenizer, engine_config(RLConfig(out="-"), episodes))
    snapshots = TaskSnapshots(fleet, max_tasks=tasks * len(keys))
    worker = RolloutWorker(engine, tokenizer, fleet, Budgets(max_turns=max_turns, max_tokens=max_tokens,
                                                             wall_clock_s=wall_clock_s),
                           snapshots=snapshots, max_tokens_per_turn=max_tokens_per_turn)  # fmt: skip
    try:
        return held_out_episodes(worker, keys, tasks, tagged=tagged, first=first, samples=samples,
                                 temperature=temperature, split=split)  # fmt: skip
    finally:
        snapshots.close()


def evaluate_policy(model, tokenizer, keys: list, tasks: int, fleet, *, tagged: bool,
                    **options) -> dict:  # fmt: skip
    """Held-out success, mean response length and the episodes the wall clock cut (`wall_clock_cut`, counted as
    failures) per key's name, over `policy_episodes` (same arguments): `summarize`."""
    return summarize(episode_results(policy_episodes(model, tokenizer, keys, tasks, fleet, tagged=tagged, **options)))
