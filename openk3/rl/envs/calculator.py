"""The calculator family: arithmetic word problems too long to do in one's head, solved with the `python` tool.

A handful of templates, each a sentence with random names, objects and 2-4 digit numbers and one fixed expression
shape (`a*b+c`, `a*b-c`, `a*b*c`, `a*b+c*d`). The demonstration copies the numbers into one call,
`python(code="print(a*b+c)")`, whose observation is the number, and answers with exactly that number. Reward: exact
match of the stripped final content with the answer (envs.exact_match). A guess (no tool) answers the result
rounded to two significant digits: the right magnitude, almost never the right number.
"""

from __future__ import annotations

import random

from openk3.rl.envs import Task, assistant, call, draw, exact_match, tool_message
from openk3.rl.tools import schemas

NAMES = ("Ann", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Max", "Ned", "Oli", "Pia",
         "Quinn", "Rex", "Sam", "Tia", "Uma", "Vic", "Wes", "Yara", "Zoe")  # fmt: skip
OBJECTS = ("apples", "pens", "cards", "stamps", "beads", "shells", "nails", "coins", "eggs", "bolts", "cups", "books",
           "seeds", "tiles", "marbles", "bottles")  # fmt: skip
# (prompt, expression, ranges of a, b, c, d). Ranges keep a*b-c positive.
TEMPLATES = (
    ("{name} packs {a} boxes of {b} {obj} and has {c} more {obj}. How many {obj} in total?", "{a}*{b}+{c}",
     (100, 9999), (12, 999), (10, 9999), None),
    ("{name} has {a} bags of {b} {obj} and gives away {c} {obj}. How many {obj} are left?", "{a}*{b}-{c}",
     (100, 9999), (12, 999), (10, 999), None),
    ("A shelf holds {a} rows of {b} {obj}; {name} adds {c}. How many {obj} now?", "{a}*{b}+{c}",
     (100, 999), (100, 999), (10, 999), None),
    ("A store has {a} crates, each with {b} boxes of {c} {obj}. How many {obj}?", "{a}*{b}*{c}",
     (12, 999), (12, 99), (12, 99), None),
    ("{name} buys {a} packs of {b} {obj} and {c} packs of {d} {obj}. How many {obj}?", "{a}*{b}+{c}*{d}",
     (12, 999), (12, 99), (12, 999), (12, 99)),
    ("What is {a} times {b}, minus {c}?", "{a}*{b}-{c}",
     (100, 9999), (100, 9999), (10, 9999), None),
)  # fmt: skip
TOOLS = schemas("python")


class Calculator:
    name = "calculator"

    def generate(self, split: str, index: int) -> Task:
        return draw(self.name, split, index, lambda rng: self._make(rng, f"{self.name}/{split}/{index}"))

    def _make(self, rng: random.Random, task_id: str) -> Task:
        t = rng.randrange(len(TEMPLATES))
        text, shape, *ranges = TEMPLATES[t]
        nums = {k: rng.randint(*r) for k, r in zip("abcd", ranges) if r is not None}
        expression = shape.format(**nums)
        prompt = text.format(name=rng.choice(NAMES), obj=rng.choice(OBJECTS), **nums)
        answer = str(eval(expression))  # our own digits and operators
        return Task(self.name, task_id, prompt, {}, answer, TOOLS, {"template": t, "expression": expression})

    def verify(self, task: Task, sandbox, final_message: dict) -> float:
        return exact_match(task, final_message)

    def demonstration(self, task: Task) -> list[dict]:
        code = f"print({task.meta['expression']})"
        return [assistant("", call("call_0", "python", code=code)), tool_message("call_0", "python", task.answer),
                assistant(task.answer)]  # fmt: skip

    def guess(self, task: Task, rng: random.Random) -> list[dict]:
        value = int(task.answer)
        digits = len(str(abs(value)))
        return [assistant(str(round(value, 2 - digits) if digits > 2 else value + rng.choice((-1, 1))))]
