"""The episode token stream: built turn by turn, it equals the XTML rendering of the whole conversation."""

from __future__ import annotations

import json

import pytest

from openk3.config import K3Config
from openk3.data.tokenizer import train_bpe
from openk3.data.xtml import encode_xtml, render_xtml
from openk3.rl.transcript import assistant_ids, episode_ids, observation_ids, prompt_ids

TOOLS = [{"type": "function", "function": {"name": "python", "description": "run code",
                                           "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                          "required": ["code"]}}}]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    text = K3Config.preset("tiny").text_config
    special = {"bos": text.bos_token_id, "eos": text.eos_token_id, "pad": text.pad_token_id}
    return train_bpe(["print(12 * 34)", "message role assistant response tools call argument"] * 20, text.vocab_size,
                     special)  # fmt: skip


def _call(i: int, code: str) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": "python", "arguments": json.dumps({"code": code})},
    }


@pytest.mark.parametrize("thinking, effort", [(False, None), (True, None), (True, "low"), (True, "max")])
def test_episode_stream_equals_the_whole_rendering(tokenizer, thinking, effort):
    initial = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 12 * 34 + 5?"}]
    turns = [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "two products first",
            "tool_calls": [_call(0, "print(12 * 34)"), _call(1, "print(5)")],
        },
        {"role": "tool", "tool_call_id": "call_0", "name": "python", "content": "408"},
        {"role": "tool", "tool_call_id": "call_1", "name": "python", "content": "5"},
        {"role": "assistant", "content": "", "tool_calls": [_call(2, "print(408 + 5)")]},
        {"role": "tool", "tool_call_id": "call_2", "name": "python", "content": "413"},
        {"role": "assistant", "content": "413"},
    ]
    kw = {"thinking": thinking}
    ids, mask = episode_ids(initial, turns, TOOLS, tokenizer, effort=effort, **kw)
    whole = encode_xtml(render_xtml(initial + turns, TOOLS, add_generation_prompt=False, thinking_effort=effort, **kw),
                        tokenizer)  # fmt: skip
    assert ids == whole
    # The loss mask covers exactly the three generated pieces, each ending with <|end_of_msg|>.
    eom = tokenizer.special_ids["<|end_of_msg|>"]
    runs, prev = [], False
    for i, m in enumerate(mask):
        if m and not prev:
            runs.append([i, i])
        if m:
            runs[-1][1] = i
        prev = m
    assert len(runs) == 3
    assert all(ids[end] == eom for _, end in runs)
    assert ids[: runs[0][0]] == prompt_ids(initial, TOOLS, tokenizer, effort=effort, **kw)
    assert ids[runs[0][0] : runs[0][1] + 1] == assistant_ids(turns[0], tokenizer, **kw)
    assert ids[runs[0][1] + 1 : runs[1][0]] == observation_ids(turns[0], turns[1:3], tokenizer, **kw)
    # The reasoning is in the stream exactly when thinking is on; the effort message exactly when one is given.
    text = tokenizer.decode(ids)
    assert ("two products first" in text) == thinking
    assert ("thinking_effort=" in text) == (effort is not None)


def test_an_effort_without_thinking_is_refused(tokenizer):
    with pytest.raises(ValueError, match="thinking=True"):
        prompt_ids([{"role": "user", "content": "hi"}], TOOLS, tokenizer, effort="low")


def test_tool_results_out_of_order_render_in_call_order(tokenizer):
    assistant = {"role": "assistant", "content": "", "tool_calls": [_call(0, "print(1)"), _call(1, "print(2)")]}
    a = {"role": "tool", "tool_call_id": "call_0", "content": "1"}
    b = {"role": "tool", "tool_call_id": "call_1", "content": "2"}
    assert observation_ids(assistant, [b, a], tokenizer) == observation_ids(assistant, [a, b], tokenizer)


def test_a_turn_that_is_not_an_assistant_message_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"turns\[0\] must be an assistant message"):
        episode_ids([{"role": "user", "content": "hi"}], [{"role": "user", "content": "again"}], None, tokenizer)
