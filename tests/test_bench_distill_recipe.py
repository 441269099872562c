"""The worked distillation recipe (the recipe section of benchmarks/distill.py): its efforts really differ in length
(the effort target's premise: teachers closer than 0.6x could not teach it), the answer and tool calls do not depend
on the effort, and the cold start's mixture follows `long_share` (mostly the top effort's reasoning, else the tag's)."""

from __future__ import annotations

import statistics

import pytest
from bench_scripts import load

from openk3.config import K3Config
from openk3.rl.envs import get_family
from openk3.rl.teachers import parse_teachers, top_efforts

distill_recipe = load("distill")  # benchmarks/distill.py
RecipeStream, demo_ids = distill_recipe.RecipeStream, distill_recipe.demo_ids
effort_turns, recipe_tokenizer = distill_recipe.effort_turns, distill_recipe.recipe_tokenizer
KEYS = sorted(parse_teachers("files:low=-,files:max=-"))


@pytest.fixture(scope="module")
def tokenizer():
    # a quarter of the recipe's corpus: faster, and the lengths barely change
    return recipe_tokenizer(KEYS, K3Config.preset("tiny").text_config, seed=0, episodes=100)


@pytest.fixture
def style_and_tag(monkeypatch):
    """Demonstrations become their (reasoning style, effort tag), so a stream's draws can be counted."""
    monkeypatch.setattr(distill_recipe, "demo_ids", lambda task, tok, *, style, tag, guess_rng=None: (style, tag))


def test_max_effort_demonstrations_are_over_twice_the_low_ones(tokenizer):
    family = get_family("files")
    lengths = {e: [] for e in ("low", "max")}
    for i in range(30):
        task = family.generate("test", i)
        for effort, found in lengths.items():
            _, mask = demo_ids(task, tokenizer, style=effort, tag=None)
            found.append(sum(mask))
    # every single demonstration, not only the mean: the budget is per task
    assert all(lo * 2 <= hi for lo, hi in zip(lengths["low"], lengths["max"])), lengths
    assert statistics.mean(lengths["low"]) / statistics.mean(lengths["max"]) < 0.5


@pytest.mark.parametrize("family", ["files", "calculator", "code-fix"])
def test_effort_changes_only_the_think_channel(family):
    task = get_family(family).generate("test", 3)
    low, high, top = (effort_turns(task, e) for e in ("low", "high", "max"))
    strip = [[{k: v for k, v in m.items() if k != "reasoning_content"} for m in t] for t in (low, high, top)]
    assert strip[0] == strip[1] == strip[2]
    assert all(m.get("reasoning_content") == "" for m in low if m["role"] == "assistant")
    for m_high, m_max in zip(high, top):
        if m_max["role"] == "assistant":
            assert len(m_max["reasoning_content"]) > 2 * len(m_high["reasoning_content"]) > 0


def _styles(tokenizer, long_share: float, n: int = 400) -> list[tuple]:
    return RecipeStream(KEYS, tokenizer, seed=0, student=True, long_share=long_share).batch(n)


def test_cold_start_mixture_follows_long_share(style_and_tag, tokenizer):
    drawn = _styles(tokenizer, 0.75)
    tags = [tag for _, tag in drawn]
    assert 0.4 < tags.count("low") / len(tags) < 0.6  # the tag is uniform
    # at the top effort's tag the reasoning is always the top effort's; at low, the top's in `long_share` of them
    assert {style for style, tag in drawn if tag == "max"} == {"max"}
    at_low = [style for style, tag in drawn if tag == "low"]
    assert 0.65 < at_low.count("max") / len(at_low) < 0.85, at_low.count("max") / len(at_low)  # ~200 draws: ±3.3 se
    assert {s for s, _ in _styles(tokenizer, 1.0, 50)} == {"max"}
    assert all(style == tag for style, tag in _styles(tokenizer, 0.0, 50))


def test_teacher_stream_is_its_effort_without_a_tag(style_and_tag, tokenizer):
    for key in KEYS:
        assert set(RecipeStream([key], tokenizer, seed=1, student=False).batch(20)) == {(key.effort, None)}


def test_long_share_out_of_range_is_refused(tokenizer):
    with pytest.raises(ValueError, match="long_share"):
        RecipeStream(KEYS, tokenizer, seed=0, student=True, long_share=1.5)


def test_top_efforts_is_the_highest_per_tagged_domain():
    keys = parse_teachers("files:low=-,files:max=-,files:high=-,code-fix:low=-,code-fix:high=-,calculator=-")
    assert top_efforts(keys) == {"files": "max", "code-fix": "high"}
