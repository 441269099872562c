"""Where a distilled student parts from its teacher on the effort recipe's files tasks: which questions it loses,
whether the loss starts at the first tool call, and how sure each model is of the one token that decides a `find`
question.

    python experiments/distill_decisive.py --tokenizer WORK/cold --teachers files:max=WORK/teacher-files-max \\
        --students start=WORK/cold,opd30=WORK/run-opd/checkpoints/step-00000030 --tasks 144 --out FILE.json

Three measurements, each per teacher key, on `--tasks` test-split tasks from `--first` (0: its first):
- **by question kind** (value, count, find; `rl/envs/files.py`): each model's greedy (or `--temperature`) episodes,
  counted as solved, and as opening with the right tool call (the first call's arguments equal the demonstration's).
  A teacher runs in its own view (no effort tag), a student in the tagged one, as `benchmarks/distill.py` judges.
- **the key copy of `find` questions**: "Which value does `salt` have? ..." is answered by grep for the key, so the
  first time an episode writes the key (at max effort in the think channel's plan, "I will call grep with pattern
  salt"; at low effort in the call's argument) is its first step: the later copies mostly follow it, and a wrong
  answer after a right call is the other half of the max key's find gap (distill-effort-decisive-views.md).
  Teacher-forced on the teacher's own greedy episodes that solved the task, each model's probability of the whole
  key there (the product over its tokens) in that model's view.
- the same models are loaded once each; one sandbox fleet serves every rollout. Episodes have no wall clock
  (`policy_episodes`): a run beside training is slower, not cut short, as one was when they had 600 s
  (distill-effort-offpolicy-g8.md).

Prints and writes {"kinds": {model: {key: {kind: counts}}}, "key_copy": {model: {key: {mean, median, share>0.5}}}},
and with --views "key_copy_views": {model: {key: {view: mean}}} (the same cases in each effort tag's view and
untagged).
"""

from __future__ import annotations

import json
import math
import statistics

import torch
from bench import distill  # benchmarks/distill.py, loaded by path (experiments/bench.py)
from distill_reeval import model_runs, runs_parser, write_result

from openk3.data.xtml_parse import parse_xtml
from openk3.rl.envs import get_family, initial_messages
from openk3.rl.evaluate import SUCCESS, policy_episodes
from openk3.rl.logprobs import sequence_logprobs
from openk3.rl.transcript import prompt_ids
from openk3.train.checkpoint import load_model

KINDS = ("value", "count", "find")


def first_turn(traj) -> list[int]:
    """The episode's first assistant turn: the generated tokens after the prompt, up to the first observation."""
    gen = traj.generated[traj.prompt_len :]
    end = gen.index(False) if False in gen else len(gen)
    return traj.tokens[traj.prompt_len : traj.prompt_len + end]


def first_call_arguments(traj, tokenizer) -> dict | None:
    """The arguments of the first tool call of the first turn, None when it calls no tool or they do not parse."""
    parsed = parse_xtml(first_turn(traj), tokenizer, start="think" if traj.thinking else "response")
    calls = parsed.message().get("tool_calls") or []
    try:
        return json.loads(calls[0]["function"]["arguments"]) if calls else None
    except (json.JSONDecodeError, KeyError):
        return None


def by_kind(trajs, tokenizer) -> dict:
    """{kind: {tasks, call_ok, solved, solved_call_ok}} over `trajs` (files tasks)."""
    out = {k: {"tasks": 0, "call_ok": 0, "solved": 0, "solved_call_ok": 0} for k in KINDS}
    family = get_family("files")
    for traj in trajs:
        want = json.loads(family.demonstration(traj.task)[0]["tool_calls"][0]["function"]["arguments"])
        row = out[traj.task.meta["kind"]]
        ok, solved = first_call_arguments(traj, tokenizer) == want, traj.reward >= SUCCESS
        row["tasks"] += 1
        row["call_ok"] += ok
        row["solved"] += solved
        row["solved_call_ok"] += ok and solved
    return out


def key_span(ids: list[int], tokenizer, key: str) -> tuple[int, int] | None:
    """(first, end): the first run of whole tokens of `ids` that decodes to `key` (spaces around it aside), None
    when there is none."""
    pieces = [tokenizer.decode([i]) for i in ids]
    for first in range(len(ids)):
        text = ""
        for end in range(first + 1, len(ids) + 1):
            text += pieces[end - 1]
            if text.strip() == key:
                return first, end
            if len(text.strip()) >= len(key) or not key.startswith(text.strip()):
                break
    return None


def key_copy_cases(trajs, tokenizer) -> list[tuple]:
    """(task, episode ids, first, end) for the teacher's solved find episodes whose first turn writes the key."""
    cases = []
    for traj in trajs:
        if traj.task.meta["kind"] != "find" or traj.reward < SUCCESS:
            continue
        ids = traj.tokens[traj.prompt_len :]
        span = key_span(first_turn(traj), tokenizer, traj.task.meta["key"])
        if span is not None:
            cases.append((traj.task, ids, *span))
    return cases


def key_probabilities(model, tokenizer, cases, *, thinking: bool, effort: str | None) -> list[float]:
    """Per case, the model's probability of the key's tokens, teacher-forced, in the view (`thinking`, `effort`)."""
    out = []
    for task, ids, first, end in cases:
        prompt = prompt_ids(initial_messages(task), task.tools, tokenizer, thinking=thinking, effort=effort)
        with torch.no_grad():
            lp = sequence_logprobs(model, [prompt + ids])[0][len(prompt) - 1 :]
        out.append(math.exp(float(lp[first:end].sum())))
    return out


def summary(p: list[float]) -> dict:
    return {"cases": len(p), "mean": sum(p) / len(p), "median": statistics.median(p),
            "share_over_half": sum(x > 0.5 for x in p) / len(p)} if p else {"cases": 0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from openk3.sandbox.fleet import Fleet

    parser = runs_parser(__doc__, "of the by-kind episodes (0: greedy)")
    parser.add_argument("--views", action="store_true",
                        help="also P(key) of every model in every view (each effort's tag, and untagged): does the "
                             "tag decide the copy, or the context it is written in?")  # fmt: skip
    args = parser.parse_args(argv)
    tokenizer, _, keys, runs = model_runs(args)
    if any(k.domain != "files" for k in keys):
        raise SystemExit("--teachers: this diagnosis knows the files family's questions only")
    result: dict = {"tasks": args.tasks, "first": args.first, "temperature": args.temperature, "kinds": {},
                    "key_copy": {}}  # fmt: skip
    if args.views:
        result["key_copy_views"] = {}
    cases: dict = {}
    with Fleet(max_sandboxes=args.tasks * len(keys) + 8, warm=2, memory_mb=256) as fleet:
        for name, path, run_keys, tagged in runs:
            model = load_model(path, dtype=torch.float32)[0].eval()
            trajs = policy_episodes(model, tokenizer, run_keys, args.tasks, fleet, tagged=tagged,
                                    temperature=args.temperature, first=args.first,
                                    **distill.RECIPE_BUDGETS)  # fmt: skip
            if not tagged:  # the teacher's greedy episodes give the key-copy cases of its key
                (key,) = run_keys
                greedy = trajs[key] if args.temperature == 0 else policy_episodes(
                    model, tokenizer, [key], args.tasks, fleet, tagged=False, first=args.first,
                    **distill.RECIPE_BUDGETS)[key]  # fmt: skip
                cases[key] = key_copy_cases(greedy, tokenizer)
            result["kinds"][name] = {str(k): by_kind(v, tokenizer) for k, v in trajs.items()}
            result["key_copy"][name] = {  # a teacher on its own key, untagged; a student on each key, tagged
                str(key): summary(key_probabilities(model, tokenizer, cases[key], thinking=True,
                                                    effort=key.effort if tagged else None))
                for key in run_keys
            }  # fmt: skip
            if args.views:  # {key whose cases: {view: mean P(key)}}, the views named by their tag
                views = {f"tag {k.effort}": k.effort for k in keys} | {"untagged": None}
                result["key_copy_views"][name] = {
                    str(key): {view: summary(key_probabilities(model, tokenizer, cases[key], thinking=True,
                                                               effort=effort)).get("mean")
                               for view, effort in views.items()}
                    for key in run_keys
                }  # fmt: skip
            print(f"{name}: {json.dumps(result['kinds'][name])}", flush=True)
    write_result(result, "key_copy", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
