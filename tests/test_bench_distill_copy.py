"""benchmarks/distill_copy.py: the calculator episodes' failure kinds and per-number copy rate."""

import distill_copy  # benchmarks/distill_copy.py (pyproject's pytest pythonpath)
import pytest


def _episode(call: str | None, answer: str) -> str:
    text = ""
    if call is not None:
        text += f'<tools><call tool="python"><argument key="code">print({call})</argument></call></tools>'
        text += f'<message role="tool">{answer}</message>'
    return text + f"<response>{answer}</response>"


def test_each_failure_is_sorted_by_where_it_went_wrong_and_numbers_are_counted_in_place():
    episodes = [
        ("12*34+56", _episode("12*34+56", "464"), 1.0),  # solved
        ("12*34+56", _episode("12*43+56", "572"), 0.0),  # one number miscopied
        ("100*200-3", _episode("200*100-3", "19997"), 0.0),  # right numbers, wrong places: only the 3 is in place
        ("12*34*56", _episode("12 * 34 * 56", "22848"), 0.0),  # right call, answer miscopied (spaces are no error)
        ("12*34+56*78", _episode(None, "4800"), 0.0),  # a guess
    ]
    got = distill_copy.copy_errors(episodes)
    assert {k: got[k] for k in distill_copy.KINDS} == {"solved": 1, "no_call": 1, "wrong_expression": 2,
                                                       "wrong_answer": 1}  # fmt: skip
    assert got["episodes"] == 5 and got["success"] == pytest.approx(0.2)
    # numbers in place: 3 + 2 + 1 (only the 3) + 3 + 0 of 3 + 3 + 3 + 3 + 4
    assert got["number_copy"] == pytest.approx(9 / 16)
    # digits: 6, 6, 7, 6 -> "<=8"; 8 -> "<=8" too
    assert got["by_digits"]["<=8"] == {"episodes": 5, "solved": 1} and got["solved_tasks"] == [0]


def test_difficulty_buckets_and_the_task_by_task_comparison_with_the_teacher():
    assert [distill_copy.digit_bucket(e) for e in ("12*34+56", "123*456+789", "1234*567+890", "1234*5678+901")] == [
        "<=8", "9", "10", ">=11"]  # fmt: skip
    teacher = distill_copy.copy_errors([("1234*567+890", "", 1.0), ("123*456+789", "", 1.0), ("12*34+5", "", 0.0)])
    student = distill_copy.copy_errors([("1234*567+890", "", 0.0), ("123*456+789", "", 1.0), ("12*34+5", "", 1.0)])
    rows = distill_copy.difficulty_table({"teacher": teacher, "student": student})
    assert rows[0].startswith("| model | <=8 digits (1 tasks) | 9 digits (1 tasks) | 10 digits (1 tasks)")
    assert rows[2] == "| teacher | 0 (0%) | 1 (100%) | 1 (100%) | - | 0 | 0 |"
    assert rows[3] == "| student | 1 (100%) | 1 (100%) | 0 (0%) | - | 1 | 1 |"


def test_the_first_call_is_read_and_nothing_is_none():
    assert distill_copy.first_expression("print(1*2)x print(3)") == "1*2"
    assert distill_copy.first_expression("no call at all") is None
    empty = {label: {"episodes": 0, "solved": 0} for label, _, _ in distill_copy.DIGIT_BUCKETS}
    assert distill_copy.copy_errors([]) == {**dict.fromkeys(distill_copy.KINDS, 0), "episodes": 0, "success": 0.0,
                                            "number_copy": None, "by_digits": empty, "solved_tasks": []}  # fmt: skip


def test_a_teacher_other_than_the_calculators_is_refused_before_anything_loads(capsys):
    with pytest.raises(SystemExit) as e:
        distill_copy.main(["--tokenizer", "/nonexistent", "--students", "s=/nonexistent",
                           "--teachers", "files:low=/nonexistent", "--out", "/nonexistent/x.json"])  # fmt: skip
    assert e.value.code == 2 and "give the calculator teacher only" in capsys.readouterr().err
