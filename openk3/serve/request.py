"""Requests and their outputs, in the shape of vLLM's offline API.

`SamplingParams` is what a user asks for; `Request` is the engine's record of one sequence being generated (one
per `n`), with its token counters: `tokens` = prompt + output so far, and `num_computed` of them are folded into the
cache. The request is prefilling while num_computed < len(tokens) - 1 and decoding when exactly one token (the
last sampled) is left to feed. `RequestOutput` / `CompletionOutput` are what `LLM.generate` returns; with
`record_routed_experts` a finished output carries the routed experts of its fed tokens (legend: P positions,
M MoE layers, k experts per token).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from openk3.data.detokenizer import IncrementalDetokenizer


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: no log-probs; k >= 0: the sampled token's plus the k most likely

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        checks = {
            "max_tokens": self.max_tokens >= 1,
            "temperature": self.temperature >= 0 and math.isfinite(self.temperature),
            "top_p": 0 < self.top_p <= 1,
            "top_k": self.top_k >= 0,
            "n": self.n >= 1,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= 20,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid SamplingParams.{name}: {getattr(self, name)!r}")


@dataclass
class ImageInputs:
    """A prompt's images after the processor (`data/vision.py::preprocess`): `pixel_values` [L, 3, p, p] of all
    images, `grid_thws` [n, 3], and each image's original (W, H). Made off the engine thread (the server's
    preprocessing threads) and encoded by the engine at `add_request`."""

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    sizes: list[tuple[int, int]]

    def __len__(self) -> int:
        return self.grid_thws.shape[0]


@dataclass
class ImageRows:
    """One image of a request: its projector rows [N, D] replace the (expanded) placeholder positions
    [start, start + N) of the prompt; `key` is its content hash (pixels and grid), mixed into the prefix-cache hash
    of every unit those positions touch."""

    start: int
    rows_ND: torch.Tensor
    key: bytes

    @property
    def end(self) -> int:
        return self.start + self.rows_ND.shape[0]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the prompt's n samples
    arrival: int = 0  # engine step of arrival (FCFS order)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why a request finished with finish_reason "error" (non-finite logits, a failed step)
    num_cached_tokens: int = 0  # effective prefix hit of the latest admission (tokens restored, not recomputed)
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None  # the output text so far, set by the engine
    # Cache resources, owned by the KV manager: KDA working slot, MLA page ids, unit hashes of `tokens`.
    slot: int | None = None
    block_ids: list[int] = field(default_factory=list)
    unit_hashes: list[bytes] = field(default_factory=list)
    planned_checkpoints: list[int] = field(default_factory=list)  # token positions, ascending
    images: list[ImageRows] = field(default_factory=list)  # image rows of the prompt, in position order
    output_checkpoint: bytes | None = None  # CheckpointPolicy.output_end: the unit hash of its latest one
    # record_routed_experts: set when the request finishes, [P, M, k] int16 (kv/routes.py)
    routed_experts: torch.Tensor | None = None

    @property
    def image_spans(self) -> list[tuple[int, int, bytes]]:
        """(start, end, content hash) of each image's rows, for the prefix-cache hashes."""
        return [(im.start, im.end, im.key) for im in self.images]

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building `tokens` (a decode step reads one token of a long context)."""
        P = len(self.prompt_token_ids)
        if start >= P:
            return self.output_token_ids[start - P : end - P]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - P)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    error: str | None = None  # with finish_reason "error": what went wrong for this sample
    message: dict | None = None  # LLM.chat: the parsed assistant message (content, reasoning_content, tool_calls)
    # record_routed_experts: once finished, int16 [P, M, k] (CPU) = the experts each MoE layer (layer order) chose
    # for positions 0..P-1 of prompt + token_ids, P = every fed position (len(prompt + token_ids) - 1 unless the
    # request ended early); None while running or when recording is off.
    routed_experts: torch.Tensor | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
