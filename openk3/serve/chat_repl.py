"""The terminal chat behind `k3 chat`: a read-eval-print loop over an `LLMEngine` and the checkpoint's chat template.

With K3's XTML format the history is OpenAI message dicts and each answer is parsed (`ChatAnswer`, as the server
parses): reasoning printed dimmed after `[thinking]`, then the content, then any tool calls (printed, not executed).
`thinking=False` renders the prompt with the think channel off (the model answers in its response channel at once),
as the server's `chat_template_kwargs={"thinking": false}` does. A plain or Jinja format streams the answer's text.
"""

from __future__ import annotations

import sys

from openk3.data.chat import Message
from openk3.serve.chat_answer import ChatAnswer
from openk3.serve.request import SamplingParams
from openk3.serve.streaming import TextDelta

THINK_TRUNCATED = "output truncated in <think>"  # the XTML parser's problem for an answer cut inside its reasoning


def chat_loop(engine, template, *, system: str | None = None, max_new_tokens: int = 256, temperature: float = 0.7,
              top_p: float = 0.95, top_k: int = 0, seed: int = 0, thinking: bool = True) -> int:  # fmt: skip
    """Read lines from stdin until EOF or /exit; /reset clears the history (keeping `system`). Turn t samples with
    seed `seed + t`. Returns the exit code."""
    xtml = template.supports_tools
    if not thinking and not xtml:
        print(f"k3 chat: this checkpoint's chat format ({template.name}) has no thinking to turn off",
              file=sys.stderr)  # fmt: skip

    def message(role: str, text: str):
        return {"role": role, "content": text} if xtml else Message(role, text)

    history = [message("system", system)] if system else []
    turn = 0
    print("k3 chat: type a message; /reset clears the conversation, /exit quits", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append(message("user", line))
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed + turn, stop=template.stop)  # fmt: skip
        ids = template.encode(history, thinking=thinking) if xtml else template.encode(history)
        engine.add_request({"prompt_token_ids": ids}, params, request_id=f"turn{turn}")
        print("k3> ", end="", flush=True)
        reply = print_xtml_answer(engine, template, params, thinking) if xtml else print_text_answer(engine, params)
        engine.release_finished(f"turn{turn}")
        history.append(reply if xtml else Message("assistant", reply))
        turn += 1


def print_text_answer(engine, params: SamplingParams) -> str:
    """Stream the running request's text to stdout; returns it."""
    delta, text = TextDelta(params.stop), ""
    while engine.has_unfinished():
        for out in engine.step():
            sample = out.outputs[0]
            text = sample.text
            print(delta.update(text, sample.finish_reason is not None), end="", flush=True)
    print()
    return text


def print_xtml_answer(engine, template, params: SamplingParams, thinking: bool = True) -> dict:
    """Stream the running request's parsed answer to stdout (reasoning dimmed, then content, then tool calls);
    returns the assistant message."""
    dim, plain = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")
    answer, channel, finish = ChatAnswer(template.parser(thinking=thinking), params.stop), None, None
    while engine.has_unfinished():
        for out in engine.step():
            sample = out.outputs[0]
            finish = sample.finish_reason
            for delta in answer.update(sample.token_ids, finish is not None):
                key = next(iter(delta))
                if key == "tool_calls":
                    continue  # printed whole below
                if key != channel:  # a new channel starts on its own line
                    lead = plain + ("\n" if channel is not None else "")
                    print(lead + (f"{dim}[thinking] " if key == "reasoning_content" else ""), end="")
                    channel = key
                print(delta[key], end="", flush=True)
    print(plain)
    message = answer.message()
    for call in message.get("tool_calls", []):
        print(f"[tool call] {call['function']['name']}({call['function']['arguments']})  (not executed)")
    _print_problems(answer.problems, finish, params.max_tokens)
    return message


def _print_problems(problems: list[str], finish: str | None, max_tokens: int) -> None:
    """What the parser found malformed; an answer cut by the token limit while still thinking is said plainly."""
    if finish == "length" and THINK_TRUNCATED in problems:
        print(f"k3 chat: the answer reached --max-new-tokens ({max_tokens}) while still thinking, before any reply; "
              f"raise --max-new-tokens, or pass --no-thinking to answer without thinking", file=sys.stderr)  # fmt: skip
        problems = [p for p in problems if p != THINK_TRUNCATED]
    if problems:
        print(f"k3 chat: malformed answer: {'; '.join(problems)}", file=sys.stderr)
