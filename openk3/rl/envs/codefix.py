"""The code-fix family: a small module `mod.py` (three one-line functions) with ONE planted bug, and `test_mod.py`,
whose cases fail because of it. Tools cat, replace, run_tests.

Bugs are operator swaps (`w * h` -> `w + h`), off-by-ones (`range(n + 1)` -> `range(n)`, `>=` -> `>`) and wrong
constants (`h * 60` -> `h * 100`, `add_7` adding 8). The prompt names the broken function (a tiny policy cannot be
expected to find it by reading every body); the function's name says what it should do. Every bug is checked to
fail at least one case, computed by running the correct and the buggy bodies on the host (our own code).

Demonstration: cat(mod.py); replace(mod.py, "return <buggy>", "return <correct>") and run_tests() in one message;
the answer "done". A guess (no tool) answers "done" without touching the module.

Reward (`verify`, in the episode's sandbox): 1 iff test_mod.py is byte-identical to the original AND its cases all
pass, run in a fresh interpreter that reads a random nonce before importing the tests and prints it with the number
of failures, so mod.py cannot fake a pass by printing or exiting early. Editing the test file scores 0.
"""

from __future__ import annotations

import random
import secrets

from openk3.rl.envs import Task, assistant, call, draw, tool_message
from openk3.rl.tools import PYTHON, TEST_FILE, schemas
from openk3.sandbox import SandboxError

VERIFY_TIMEOUT_S = 10.0
MODULE = "mod.py"
FUNCTIONS_PER_MODULE = 3


def _ints(lo: int, hi: int, n: int):
    return lambda rng: tuple(rng.randint(lo, hi) for _ in range(n))


def _list(rng: random.Random, odd: bool = False) -> tuple:
    n = rng.choice((3, 5)) if odd else rng.randint(3, 5)
    return (rng.sample(range(1, 50), n),)


def _range3(rng: random.Random) -> tuple:
    lo, hi = sorted(rng.sample(range(30), 2))
    return (rng.choice((lo, hi, rng.randint(lo - 5, hi + 5))), lo, hi)


# (name, parameters, correct body, buggy bodies, test arguments). `{k}` is a per-task constant 2..9 (`{k1}` = k + 1).
TEMPLATES = (
    ("add_{k}", "x", "x + {k}", ("x - {k}", "x + {k1}"), _ints(0, 99, 1)),
    ("times_{k}", "x", "x * {k}", ("x + {k}", "x * {k1}"), _ints(2, 99, 1)),
    ("area", "w, h", "w * h", ("w + h", "w * w"), _ints(3, 30, 2)),
    ("perimeter", "w, h", "2 * (w + h)", ("2 * w + h", "2 * (w - h)"), _ints(1, 30, 2)),
    ("is_even", "n", "n % 2 == 0", ("n % 2 == 1", "n % 3 == 0"), _ints(0, 99, 1)),
    ("clamp", "x, lo, hi", "max(lo, min(x, hi))", ("min(lo, min(x, hi))", "max(lo, max(x, hi))"), _range3),
    ("is_adult", "age", "age >= 18", ("age > 18", "age >= 21"), lambda rng: (rng.choice((18, rng.randint(10, 30))),)),
    ("maximum", "a, b", "a if a > b else b", ("a if a < b else b", "b if a > b else a"), _ints(0, 99, 2)),
    ("sum_to", "n", "sum(range(n + 1))", ("sum(range(n))", "sum(range(n - 1))"), _ints(1, 20, 1)),
    ("last", "xs", "xs[len(xs) - 1]", ("xs[len(xs) - 2]", "xs[0]"), _list),
    ("square", "x", "x * x", ("x * 2", "x + x"), _ints(3, 30, 1)),
    ("is_positive", "x", "x > 0", ("x >= 0", "x < 0"), lambda rng: (rng.choice((0, rng.randint(-9, 9))),)),
    ("count_up", "n", "list(range(1, n + 1))", ("list(range(1, n))", "list(range(n))"), _ints(1, 6, 1)),
    ("middle", "xs", "xs[len(xs) // 2]", ("xs[len(xs) // 2 - 1]", "xs[len(xs) % 2]"), lambda rng: _list(rng, True)),
    ("minutes", "h", "h * 60", ("h * 100", "h + 60"), _ints(2, 24, 1)),
    ("average", "a, b", "(a + b) / 2", ("a + b / 2", "(a + b) // 2"), _ints(1, 99, 2)),
    ("distance", "a, b", "abs(a - b)", ("a - b", "abs(a + b)"), _ints(0, 99, 2)),
    ("in_range", "x, lo, hi", "lo <= x <= hi", ("lo < x <= hi", "lo <= x < hi"), _range3),
)  # fmt: skip
TOOLS = schemas("cat", "replace", "run_tests")

TEST_HEAD = "import mod\n\nCASES = [\n"
TEST_TAIL = """\
]


def check():
    failed = []
    for name, args, want in CASES:
        try:
            got = getattr(mod, name)(*args)
        except Exception as e:
            got = e
        if got != want:
            failed.append(f"FAIL {name}({', '.join(map(repr, args))}) = {got!r}, expected {want!r}")
    return failed


if __name__ == "__main__":
    failed = check()
    print("\\n".join(failed + [f"{len(CASES) - len(failed)} passed, {len(failed)} failed"]))
    raise SystemExit(1 if failed else 0)
"""
# Run by verify: the nonce is read before mod.py is imported, so nothing in mod.py can print it.
CHECK = "import sys; nonce = sys.stdin.read().strip(); import test_mod; print(nonce, len(test_mod.CASES), len(test_mod.check()))"  # fmt: skip


def _call(params: str, body: str, args: tuple):
    try:
        return eval(f"lambda {params}: {body}")(*args)  # our own templates
    except Exception as e:  # noqa: BLE001 -- a buggy body may raise; that fails its case too
        return e


def summary(passed: int, failed: int = 0) -> str:
    """The last line of run_tests' output."""
    return f"{passed} passed, {failed} failed"


class CodeFix:
    name = "code-fix"

    def generate(self, split: str, index: int) -> Task:
        return draw(self.name, split, index, lambda rng: self._make(rng, f"{self.name}/{split}/{index}"))

    def _make(self, rng: random.Random, task_id: str) -> Task:
        while True:
            task = self._candidate(rng, task_id)
            if task is not None:
                return task

    def _candidate(self, rng: random.Random, task_id: str) -> Task | None:
        """A task, or None when this draw's bug is not unique in the file or no case tells it apart."""
        k = rng.randint(2, 9)
        chosen = rng.sample(TEMPLATES, FUNCTIONS_PER_MODULE)
        broken = rng.randrange(FUNCTIONS_PER_MODULE)
        sources, cases = [], []
        for i, (name, params, body, bugs, args_of) in enumerate(chosen):
            name, body = name.format(k=k), body.format(k=k)
            if i == broken:
                fname, correct, bug = name, body, rng.choice(bugs).format(k=k, k1=k + 1)
                telling = [
                    a for a in (args_of(rng) for _ in range(30)) if _call(params, body, a) != _call(params, bug, a)
                ]
                if not telling:
                    return None
                cases += [(name, telling[0], _call(params, body, telling[0]))]
                body = bug
            a = args_of(rng)
            cases.append((name, a, _call(params, chosen[i][2].format(k=k), a)))
            sources.append(f"def {name}({params}):\n    return {body}\n")
        module = "\n".join(sources)
        old, new = f"return {bug}", f"return {correct}"
        if module.count(old) != 1:
            return None
        tests = TEST_HEAD + "".join(f"    ({n!r}, {a!r}, {w!r}),\n" for n, a, w in cases) + TEST_TAIL
        prompt = f"Fix the bug in `{fname}` in {MODULE} so that {TEST_FILE} passes."
        meta = {"function": fname, "old": old, "new": new, "num_cases": len(cases)}
        return Task(self.name, task_id, prompt, {MODULE: module, TEST_FILE: tests}, None, TOOLS, meta)

    def verify(self, task: Task, sandbox, final_message: dict) -> float:
        try:
            if sandbox.read_file(f"/workspace/{TEST_FILE}") != task.files[TEST_FILE].encode():
                return 0.0
            nonce = secrets.token_hex(8)
            result = sandbox.exec([*PYTHON, "-c", CHECK], timeout=VERIFY_TIMEOUT_S, stdin=nonce, cwd="/workspace")
        except (OSError, SandboxError):
            return 0.0
        lines = result.stdout.strip().splitlines()
        passed = (
            not result.timed_out and result.exit_code == 0 and lines[-1:] == [f"{nonce} {task.meta['num_cases']} 0"]
        )
        return float(passed)

    def demonstration(self, task: Task) -> list[dict]:
        fix = call("call_1", "replace", path=MODULE, old=task.meta["old"], new=task.meta["new"])
        return [
            assistant("", call("call_0", "cat", path=MODULE)),
            tool_message("call_0", "cat", task.files[MODULE].rstrip("\n")),
            assistant("", fix, call("call_2", "run_tests")),
            tool_message("call_1", "replace", "ok"),
            tool_message("call_2", "run_tests", summary(task.meta["num_cases"])),
            assistant("done"),
        ]

    def guess(self, task: Task, rng: random.Random) -> list[dict]:
        return [assistant("done")]
