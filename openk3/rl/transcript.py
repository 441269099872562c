"""The token stream of an agent episode, built turn by turn and never re-rendered from text.

An episode's tokens are the concatenation of:

    prompt        render_xtml(initial messages, tools, generation prompt)        not trained on
    generated     the assistant message after its generation prompt, as sampled  trained on (loss mask True)
    observation   the tool messages that answer it, then the next generation prompt   not trained on
    generated     ...

Each piece is the slice of K3's XTML rendering (`data/xtml.py`) that a message adds, so for a conversation rendered from
messages the stream is exactly `encode_xtml(render_xtml(all messages))` (tested): the rollout and the SFT warm start
build the same ids, and a rollout's later turns are the earlier turns' sampled ids verbatim. Open RL stacks that
re-render the chat between turns change the tokenisation; here the history is only ever appended to. Thinking is off by
default (the generation prompt opens the `response` channel): the tiny agents answer directly. With `thinking=True` it
opens the `think` channel, every assistant message carries its (maybe empty) think element, and `effort` adds the
release's thinking-effort system message to the prompt (distillation's effort tags).
"""

from __future__ import annotations

from openk3.data.xtml import Segment, encode_xtml, render_xtml

THINKING = False


def _segments(messages: list[dict], tools: list[dict] | None = None, prompt: bool = False, thinking: bool = THINKING,
              effort: str | None = None) -> list[Segment]:  # fmt: skip
    return render_xtml(messages, tools, add_generation_prompt=prompt, thinking=thinking, thinking_effort=effort)


def _suffix(whole: list[Segment], head: list[Segment], what: str) -> list[Segment]:
    """`whole` minus its prefix `head` (the rendering is message by message, so a prefix always matches)."""
    if whole[: len(head)] != head:
        raise AssertionError(f"XTML rendering of {what} does not extend its prefix; the format changed")
    return whole[len(head) :]


def prompt_ids(messages: list[dict], tools: list[dict] | None, tokenizer, *, thinking: bool = THINKING,
               effort: str | None = None) -> list[int]:  # fmt: skip
    """The episode's first tokens: the tool declaration, the thinking-effort message (`effort`, thinking on), the
    initial messages and the assistant generation prompt."""
    if effort is not None and not thinking:
        raise ValueError(f"effort={effort!r} needs thinking=True: the release renders the effort only with thinking on")
    return encode_xtml(_segments(messages, tools, prompt=True, thinking=thinking, effort=effort), tokenizer)


def assistant_ids(message: dict, tokenizer, *, thinking: bool = THINKING) -> list[int]:
    """What a policy generates for `message`: its rendering after the generation prompt, through <|end_of_msg|>."""
    head = _segments([], prompt=True, thinking=thinking)
    return encode_xtml(_suffix(_segments([message], thinking=thinking), head, "an assistant message"), tokenizer)


def observation_ids(assistant: dict, tool_messages: list[dict], tokenizer, *, thinking: bool = THINKING) -> list[int]:
    """The tool results that answer `assistant`'s calls, then the next generation prompt (the results' `index`
    attributes and tool names come from the assistant's calls, hence it is rendered too and cut off)."""
    whole = _segments([assistant, *tool_messages], prompt=True, thinking=thinking)
    return encode_xtml(_suffix(whole, _segments([assistant], thinking=thinking), "tool results"), tokenizer)


def episode_ids(initial: list[dict], turns: list[dict], tools: list[dict] | None, tokenizer, *,
                thinking: bool = THINKING, effort: str | None = None) -> tuple[list[int], list[bool]]:  # fmt: skip
    """(tokens, loss mask) of a whole episode given as messages: `initial` (system/user), then `turns` (assistant
    messages, each followed by the tool messages answering it). The SFT warm start trains on demonstrations
    through this, so they are tokenised exactly as rollouts are."""
    ids = prompt_ids(initial, tools, tokenizer, thinking=thinking, effort=effort)
    mask = [False] * len(ids)
    i = 0
    while i < len(turns):
        assistant = turns[i]
        if assistant.get("role") != "assistant":
            raise ValueError(f"turns[{i}] must be an assistant message, got role {assistant.get('role')!r}")
        gen = assistant_ids(assistant, tokenizer, thinking=thinking)
        ids += gen
        mask += [True] * len(gen)
        j = i + 1
        while j < len(turns) and turns[j].get("role") == "tool":
            j += 1
        if j > i + 1:
            obs = observation_ids(assistant, turns[i + 1 : j], tokenizer, thinking=thinking)
            ids += obs
            mask += [False] * len(obs)
        i = j
    return ids, mask
