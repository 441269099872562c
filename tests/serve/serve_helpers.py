"""Shared pieces of the serving tests: a tiny random model, margin-aware greedy references, logit capture."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import socket
import threading
import time

import torch
import uvicorn

from openk3 import K3ForCausalLM
from openk3.data.tokenizer import train_bpe
from openk3.serve.config import ServeConfig
from openk3.serve.engine import LLMEngine

MARGIN = 1e-4  # compare greedy tokens only where the top-2 logit margin is clear


def tiny_model(seed: int = 0) -> K3ForCausalLM:
    model = K3ForCausalLM("tiny")
    model.init_random_weights(seed)
    return model.eval()


def random_prompt(n: int, seed: int, vocab: int = 760) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> tuple[list[int], int]:
    """`model.generate` tokens, and how many of them are trustworthy: the steps before the first near-tie, where
    a last-bit difference could legitimately flip the argmax."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=n)[0, len(prompt) :].tolist()
    logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(out)]
    top2 = logits.topk(2, -1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    clear = next((i for i, m in enumerate(margins) if m <= MARGIN), len(margins))
    return out, clear


def make_engine(model, **options) -> LLMEngine:
    return LLMEngine(model, None, ServeConfig.from_options(**options))


def run_outputs(engine: LLMEngine, check: bool = True) -> dict:
    """Step until idle (checking the pool invariants after every step); the final RequestOutput of every request."""
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.manager.check()
    return done


def run_to_end(engine: LLMEngine, check: bool = True) -> dict[str, list[int]]:
    """`run_outputs`, as the token ids of each request's first sample."""
    return {rid: out.outputs[0].token_ids for rid, out in run_outputs(engine, check).items()}


def slow_steps(monkeypatch, engine: LLMEngine, seconds: float) -> None:
    """Make every engine step take at least `seconds` (undone with `monkeypatch`), so a request of n tokens lasts at
    least n * seconds on any machine: disconnect tests then always drop it mid-generation, however fast the CPU."""
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


class LogitTap:
    """Records the fp32 logits the runner returns, per request id, in order."""

    def __init__(self, engine: LLMEngine):
        self.rows: dict[str, list[torch.Tensor]] = {}
        run = engine.runner.run

        def tapped(reqs, ids, rows, verify=False):
            logits, records = run(reqs, ids, rows, verify)
            i = 0
            for req, r in zip(reqs, rows):
                for _ in r:
                    self.rows.setdefault(req.request_id, []).append(logits[i].clone())
                    i += 1
            return logits, records

        engine.runner.run = tapped


@contextlib.contextmanager
def serve_on_loopback(app):
    """Run a FastAPI app under uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@functools.cache
def bpe_tokenizer(vocab_size: int, bos: int, eos: int, pad: int):
    """A small byte-level BPE trained on two stdlib modules' source (the servers' tests use a real BPE)."""
    corpus = [inspect.getsource(json), inspect.getsource(socket)] * 2
    return train_bpe(corpus, vocab_size, {"bos": bos, "eos": eos, "pad": pad})


class ScriptedSampler:
    """Stands in for the engine's `_sample`: each request gets the next id of the script registered for its prompt
    ids (by how many tokens it has produced), so a random tiny model 'writes' a chosen answer. Unregistered prompts
    get `default`. `prompts` records each request's prompt ids as its first token is drawn: what the server built."""

    def __init__(self, default: list[int]):
        self.scripts: dict[tuple[int, ...], list[int]] = {}
        self.default = default
        self.prompts: list[list[int]] = []

    def add(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        self.scripts[tuple(prompt_ids)] = answer_ids

    def __call__(self, reqs, logits_NV) -> list[int]:
        out = []
        for req in reqs:
            script = self.scripts.get(tuple(req.prompt_token_ids), self.default)
            if not req.output_token_ids:
                self.prompts.append(list(req.prompt_token_ids))
            out.append(script[min(len(req.output_token_ids), len(script) - 1)])
        return out


def xtml_answer_ids(template, message: dict, thinking: bool = True) -> list[int]:
    """The ids the model writes for an assistant `message` in K3's XTML format (after the generation prompt, up to
    and including <|end_of_msg|>): the rendered message minus the rendered prompt, segment for segment."""
    from openk3.data.xtml import encode_xtml

    user = {"role": "user", "content": "x"}
    full = template.render([user, message], add_generation_prompt=False, thinking=thinking)
    prompt = template.render([user], add_generation_prompt=True, thinking=thinking)
    assert full[: len(prompt)] == prompt
    return encode_xtml(full[len(prompt) :], template.tokenizer)
