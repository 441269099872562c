"""Shared pieces of the serving tests: a tiny random model, margin-aware greedy references, logit capture."""

from __future__ import annotations

import torch

from openk3 import K3ForCausalLM
from openk3.serve.config import ServeConfig
from openk3.serve.engine import LLMEngine

MARGIN = 1e-4  # STYLE.md §5: compare greedy tokens only where the top-2 logit margin is clear


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
    logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : len(prompt) - 1 + len(out)]
    top2 = logits.topk(2, -1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    clear = next((i for i, m in enumerate(margins) if m <= MARGIN), len(margins))
    return out, clear


def make_engine(model, **options) -> LLMEngine:
    return LLMEngine(model, None, ServeConfig.from_options(**options))


def run_to_end(engine: LLMEngine, check: bool = True) -> dict[str, list[int]]:
    """Step until idle (checking the pool invariants after every step); token ids of every finished sample."""
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if check:
            engine.manager.check()
    return done


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
