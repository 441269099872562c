"""The engine: `LLMEngine.step()` = schedule -> run -> sample -> update, and the offline `LLM.generate`.

    llm = LLM("ckpt_dir", enable_prefix_caching=True, speculative_config={"method": "ngram",
              "num_speculative_tokens": 4}, max_num_batched_tokens=2048)
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids
    llm.chat([{"role": "user", "content": "Hi"}], tools=[...])[0].outputs[0].message  # parsed, as the server does

Images (a `K3ForConditionalGeneration`; `LLM(dir)` loads one when the checkpoint has a vision_config), in vLLM's
multimodal prompt form:

    llm.generate({"prompt": "Describe <|media_pad|> and <|media_pad|>.", "multi_modal_data": {"image": [im1, im2]}})

Each image stands where its placeholder `<|media_pad|>` (`media_placeholder_token_id`) is: written once per image in
the prompt text (only there is that name encoded as the special id; the rest of the text is ordinary text), or in
`prompt_token_ids` once per image (expanded here to its N = `num_image_tokens` rows) or N times in a row (kept).
A count mismatch is a ValueError naming the counts. `add_request` encodes each image once (`encode_images`) and
keeps its rows and positions on the Request; the runner merges them into every forward that covers them, and the
prefix-cache hashes of the units they touch include the image's content hash (kv/prefix.py). Speculative decoding
stays text-only: drafts extend the sequence past the prompt, where no image rows are.

Each step asks the proposer for drafts (when speculating), schedules, then runs one forward over the scheduled
prefill chunks and plain decodes, plus one verify forward per draft length. The sampled rows of a forward are drawn
in one batched call (`ops.sampling.sample_rows`), each row from its request's generator (seeded from
`SamplingParams.seed` and the sample index), so a request's tokens do not depend on what it was batched with. Output
text grows incrementally per sample (`data/detokenizer.py`), stop strings are searched in the new text only.

As an RL rollout engine: `record_routed_experts=True` returns each finished sample's routed experts
(`CompletionOutput.routed_experts`, read from the routes pool before its pages are released, kv/routes.py), and
`update_weights(state_dict, version)` copies new weights in place between steps (no request may be running or
waiting): the version is mixed into the prefix-cache hashes, so no state computed under older weights is ever
served, and the cache is reset to free its memory at once. A draft model proposer keeps its own weights.

Legend: N sampled rows, G tokens per verified request (1 + drafts), V vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from openk3.config import K3Config
from openk3.data.chat import check_text, load_chat_template
from openk3.data.detokenizer import IncrementalDetokenizer
from openk3.data.tokenizer import ByteTokenizer, load_tokenizer
from openk3.data.vision import image_prompt, load_media_proc_cfg, num_image_tokens, preprocess
from openk3.model.cache import cache_specs
from openk3.model.model import K3ForCausalLM
from openk3.model.multimodal import K3ForConditionalGeneration, placeholder_spans
from openk3.ops.sampling import GREEDY_BELOW, sample_rows, sampling_probs_rows
from openk3.serve.config import DEFAULT_MAX_IMAGE_PIXELS, ServeConfig, resolve_dtype, serving_dtype
from openk3.serve.kv.manager import KVCacheManager
from openk3.serve.kv.routes import ROUTE_DTYPE, num_moe_layers
from openk3.serve.protocol import FieldError, chat_request
from openk3.serve.request import (
    CompletionOutput,
    ImageInputs,
    ImageRows,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
)  # fmt: skip
from openk3.serve.runner import ModelRunner
from openk3.serve.scheduler import Scheduler
from openk3.serve.spec_decode import AdaptiveProposer, DraftModelProposer, NgramProposer, accept, fold

log = logging.getLogger("openk3.serve")


@dataclass
class SpecStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


NON_FINITE = "the model produced non-finite logits (NaN or inf) for this request"


def _finite_rows(logits_NV: torch.Tensor) -> list[bool]:
    """Which rows can be sampled from: a NaN or inf logit (a broken checkpoint, an overflow) has no distribution."""
    return torch.isfinite(logits_NV).all(-1).tolist()


def _sample(reqs: list[Request], logits_NV: torch.Tensor) -> list[int | None]:
    """One token per row, row n for request n (None where the row is not finite), in one batched call."""
    finite = _finite_rows(logits_NV)
    keep = [n for n, ok in enumerate(finite) if ok]
    tokens: list[int | None] = [None] * len(reqs)
    if keep:
        params = [reqs[n].params for n in keep]
        drawn = sample_rows(logits_NV[keep], [p.temperature for p in params], [p.top_k for p in params],
                            [p.top_p for p in params], [reqs[n].generator for n in keep]).tolist()  # fmt: skip
        for n, tok in zip(keep, drawn):
            tokens[n] = tok
    return tokens


def _verify_probs(reqs: list[Request], logits_NGV: torch.Tensor, finite: list[bool]) -> list[torch.Tensor | None]:
    """Each verified request's sampling distributions [G, V] (None for greedy and non-finite requests), the sampled
    requests' rows in one batched call."""
    sampled = [n for n, req in enumerate(reqs) if finite[n] and req.params.temperature >= GREEDY_BELOW]
    out: list[torch.Tensor | None] = [None] * len(reqs)
    if sampled:
        G = logits_NGV.shape[1]
        params = [reqs[n].params for n in sampled for _ in range(G)]
        probs = sampling_probs_rows(logits_NGV[sampled].flatten(0, 1), [p.temperature for p in params],
                                    [p.top_k for p in params], [p.top_p for p in params])  # fmt: skip
        for i, n in enumerate(sampled):
            out[n] = probs[i * G : (i + 1) * G]
    return out


MEDIA_PAD = "<|media_pad|>"  # the image placeholder's name in a text prompt


def _expand_placeholders(ids: list[int], rows_N: list[int], token_id: int) -> tuple[list[int], list[int]]:
    """Prompt ids with each image's placeholder (one, or N_k in a row) as N_k placeholders, and where each
    image's rows start. Raises ValueError naming the counts when the placeholders do not fit the images."""
    is_ph_BT = torch.tensor([ids], dtype=torch.long) == token_id
    spans = placeholder_spans(is_ph_BT, rows_N, token_id)
    out, starts, prev = [], [], 0
    for k, ((positions, _), N) in enumerate(zip(spans, rows_N)):
        if positions[-1] - positions[0] + 1 != len(positions):
            raise ValueError(f"image {k}'s {len(positions)} placeholder tokens (id {token_id}) are not consecutive")
        out += ids[prev : positions[0]]
        starts.append(len(out))
        out += [token_id] * N
        prev = positions[-1] + 1
    return out + ids[prev:], starts


class LLMEngine:
    def __init__(self, model: K3ForCausalLM | K3ForConditionalGeneration, tokenizer=None,
                 config: ServeConfig | None = None, media_proc_cfg: dict | None = None):  # fmt: skip
        # The engine serves the text model; a vision model's tower only encodes images at add_request.
        self.vision_model = model.eval() if isinstance(model, K3ForConditionalGeneration) else None
        self.media_proc_cfg = media_proc_cfg  # None: the release's processor settings
        if self.vision_model is not None:
            model = self.vision_model.language_model
        self.model = model.eval()
        text = model.text_config
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer(text.vocab_size)
        config = config or ServeConfig()
        # One MLA page holds block_size tokens of every MLA layer's latent (the same CacheSpecs the pools use).
        page_bytes = config.block_size * sum(s.bytes_per_token for s in cache_specs(text, model.lm_head.weight.dtype))
        if config.record_routed_experts:  # the routes pool rides along the pages (kv/routes.py)
            page_bytes += config.block_size * num_moe_layers(text) * text.num_experts_per_token * ROUTE_DTYPE.itemsize
        self.config = config.resolve(text.max_position_embeddings, page_bytes)
        p = model.lm_head.weight
        self.manager = KVCacheManager(text, self.config, p.dtype, p.device)
        self.scheduler = Scheduler(self.config, self.manager)
        self.runner = ModelRunner(model, self.manager)
        self.proposer = self._make_proposer()
        self.spec_stats = SpecStats()
        self.eos_token_id = text.eos_token_id
        self.requests: dict[str, list[Request]] = {}
        self._prompts: dict[str, str | None] = {}
        self._counter = itertools.count()
        self.step_count = 0
        self._weight_version = 0
        # Contained failures (a step that raised, or the caller's fail_all): how many, when the last was, and why.
        self.failed_steps, self.last_failure, self.last_error = 0, float("-inf"), None
        log.debug("%s", self.cache_summary())  # `k3 serve` prints it in its header; every engine logging it is noise

    def cache_summary(self) -> str:
        """One line on the cache's pools, e.g. `cache: 512 MLA pages of 16 tokens (...)`."""
        info = self.cache_info()
        return (
            f"cache: {info['num_blocks']} MLA pages of {info['block_size']} tokens ({info['mla_bytes_per_token']} B "
            f"per token, {info['mla_pool_bytes'] / 2**20:.1f} MiB), {info['num_slots']} KDA state slots of "
            f"{info['bytes_per_request'] / 2**20:.2f} MiB ({self.config.max_num_seqs} for running requests, "
            f"{self.config.max_num_checkpoints} for checkpoints)"
        )

    def cache_info(self) -> dict[str, int]:
        """The cache's memory, read from the allocated pools: MLA bytes per token, fixed KDA bytes per request."""
        pools, routes = self.manager.pools, self.manager.routes
        routes_bytes = routes.nbytes() if routes is not None else 0
        return {
            "mla_bytes_per_token": pools.mla_bytes_per_token(),
            "bytes_per_request": pools.slot_bytes(),
            "block_size": pools.block_size,
            "num_blocks": pools.num_blocks,
            "mla_pool_bytes": pools.latent_MNBR.numel() * pools.latent_MNBR.element_size(),
            "num_slots": pools.num_slots - 1,  # slot 0 is the dummy
            "routes_pool_bytes": routes_bytes,  # record_routed_experts only
            "total_bytes": pools.nbytes() + routes_bytes,
        }

    def _make_proposer(self):
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "ngram":
            return AdaptiveProposer(NgramProposer(spec.prompt_lookup_max, spec.prompt_lookup_min))
        draft = spec.model
        if isinstance(draft, (str, os.PathLike)):
            draft = K3ForCausalLM.from_pretrained(draft, dtype=next(self.model.parameters()).dtype)
        return AdaptiveProposer(DraftModelProposer(draft.eval(), self.model.text_config.vocab_size))

    # ---- requests --------------------------------------------------------------------------------------------
    def add_request(
        self, prompt: str | dict | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a prompt (text, `{"prompt_token_ids": [...]}`, a list of ids, or either dict form with
        `"multi_modal_data": {"image": PIL image | list | ImageInputs}`); returns its request id."""
        params = params or SamplingParams()
        images: list[ImageRows] = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            text, ids, images = self._multimodal_prompt(prompt)
        elif isinstance(prompt, str):
            text, ids = prompt, self.encode_prompt(prompt)
        elif isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            text, ids = None, list(prompt)
        vocab = self.model.text_config.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len {self.config.max_model_len} leaves no room to generate"
            )
        request_id = request_id if request_id is not None else str(next(self._counter))
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        reqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
            req = Request(request_id, ids, params, index=i, arrival=self.step_count, generator=gen,
                          detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop), images=images)  # fmt: skip
            reqs.append(req)
            self.scheduler.add(req)
        self.requests[request_id] = reqs
        self._prompts[request_id] = text
        return request_id

    def process_images(self, images, max_pixels: int | None = None) -> ImageInputs:
        """The processor's tensors of a PIL image or a list of them (CPU work: the server runs it off its event
        loop). Raises ValueError for a non-image or one over `max_pixels`."""
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        options = {} if max_pixels is None else {"max_pixels": max_pixels}
        pixel_values, grid_thws = preprocess(images, self.media_proc_cfg, **options)
        return ImageInputs(pixel_values, grid_thws, [im.size for im in images])

    def _multimodal_prompt(self, prompt: dict) -> tuple[str | None, list[int], list[ImageRows]]:
        """(text, expanded ids, image rows) of a prompt with `multi_modal_data`; the images are encoded here, once."""
        if self.vision_model is None:
            raise ValueError("images need a vision checkpoint (one with a vision_config); this model is text-only")
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data: only {'image': PIL image or list of them} is supported")
        inputs = data.get("image")
        if not isinstance(inputs, ImageInputs):
            inputs = self.process_images(inputs)
        token_id = self.vision_model.config.media_placeholder_token_id
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(text, str):
            ids = self.encode_prompt_with_images(text, token_id)
        else:
            raise ValueError("a multimodal prompt needs 'prompt' (text) or 'prompt_token_ids'")
        grids = inputs.grid_thws.tolist()
        rows_N = [num_image_tokens(g) for g in grids]
        ids, starts = _expand_placeholders(ids, rows_N, token_id)
        tower = self.vision_model.vision_tower
        device = next(tower.parameters()).device
        with torch.inference_mode():
            features = self.vision_model.encode_images(inputs.pixel_values.to(device), inputs.grid_thws.to(device))
        images, offset = [], 0
        for g, start, rows_ND in zip(grids, starts, features):
            n_patches = g[0] * g[1] * g[2]
            pixels = inputs.pixel_values[offset : offset + n_patches].contiguous().numpy().tobytes()
            offset += n_patches
            key = hashlib.sha256(pixels + torch.tensor(g, dtype=torch.int64).numpy().tobytes()).digest()
            images.append(ImageRows(start, rows_ND, key))
        return text, ids, images

    def encode_prompt_with_images(self, text: str, token_id: int) -> list[int]:
        """A text prompt's ids where each `<|media_pad|>` written in it is the placeholder id (one per image);
        everything else is ordinary text."""
        pieces = text.split(MEDIA_PAD)
        ids = self.encode_prompt(pieces[0])
        for piece in pieces[1:]:
            check_text(piece, "prompt")
            ids += [token_id] + (self.tokenizer.encode(piece) if piece else [])
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """A text prompt's token ids (with BOS, except for the byte-level fallback). Text that is not valid
        Unicode (a lone surrogate such as "\\ud800", which JSON can spell) is a ValueError, not a tokenizer crash."""
        check_text(text, "prompt")
        return self.tokenizer.encode(text, add_bos=not isinstance(self.tokenizer, ByteTokenizer))

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its slot and pages (e.g. a client disconnected)."""
        for req in self.requests.pop(request_id, []):
            if not req.is_finished:
                req.finish_reason = "abort"
                self._finish(req)
        self._prompts.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- weights ---------------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        """The version of the weights being served (0 at start; `update_weights` sets it). Setting it directly
        (e.g. a trainer resuming at its step) also keys the prefix cache by it."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._weight_version = version
        self.manager.set_weight_version(version)

    def update_weights(self, weights: dict[str, torch.Tensor] | torch.nn.Module, version: int | None = None) -> int:
        """Copy `weights` (a state dict with the engine model's names, or a model) into the model in place, cast to
        each tensor's dtype; returns the new `weight_version` (`version`, default the current one + 1). Every name and
        shape is checked before anything is copied: a missing or unexpected name or a shape mismatch is a ValueError
        and changes nothing. Raises RuntimeError while any request is running or waiting (finish or abort them
        first). The prefix cache is reset and keyed by the new version. A draft model proposer is left as it is."""
        if self.scheduler.has_work():
            raise RuntimeError(
                f"update_weights with {len(self.scheduler.running)} running and {len(self.scheduler.waiting)} waiting "
                "requests: finish or abort them first"
            )
        self.runner.load_weights(weights)
        self.weight_version = self.weight_version + 1 if version is None else version
        self.reset_prefix_cache()
        return self.weight_version

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry no running request holds (checkpoints, cached pages); returns the number of
        pages freed."""
        return self.manager.reset_prefix_cache()

    # ---- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the current output of every request that produced tokens or finished."""
        plan = self.scheduler.schedule(self._propose())
        if plan.num_tokens == 0 and self.scheduler.waiting and not self.scheduler.running:
            # Cannot happen with a resolved config (it holds one max_model_len request); never spin silently.
            raise RuntimeError("the engine is idle but cannot admit the next request: the cache pool is too small")
        touched: dict[str, None] = {}
        try:
            self._run(plan, touched)
        except Exception as err:
            log.exception("engine step %d failed; failing the requests it ran", self.step_count)
            message = f"the engine step failed: {type(err).__name__}: {err}"
            self._record_failure(message)
            for req in [c.req for c in plan.chunks] + [req for group in plan.verify.values() for req, _ in group]:
                self._fail(req, message)
                touched[req.request_id] = None
        self.step_count += 1
        return [self._output(rid) for rid in touched if rid in self.requests]

    def _propose(self) -> dict[int, list[int]]:
        """Drafts for every decoding request (id(req) -> tokens), each within the room the scheduler leaves it;
        the scheduler cuts them further to the step's token budget."""
        if self.proposer is None:
            return {}
        rooms = ((req, self.scheduler.draft_room(req)) for req in self.scheduler.running)
        return {id(req): self.proposer(req, room) for req, room in rooms if room > 0}

    def _run(self, plan, touched: dict[str, None]) -> None:
        if plan.chunks:
            reqs = [c.req for c in plan.chunks]
            ids = [c.req.token_range(c.req.num_computed, c.req.num_computed + c.num_tokens) for c in plan.chunks]
            samples = [c.req.num_computed + c.num_tokens == c.req.num_tokens for c in plan.chunks]
            rows = [[len(x) - 1] if s else [] for x, s in zip(ids, samples)]
            logits, _ = self.runner.run(reqs, ids, rows)
            tokens = _sample([r for r, s in zip(reqs, samples) if s], logits)
            row = 0
            for chunk, sampled in zip(plan.chunks, samples):
                req = chunk.req
                if req.is_finished:  # a sibling sample failed earlier in this step and ended the whole request
                    row += sampled
                    continue
                req.num_computed += chunk.num_tokens
                self.manager.commit(req)
                if sampled:
                    if tokens[row] is not None:
                        self._emit(req, [tokens[row]], logits[row : row + 1])
                    else:
                        self._fail(req, NON_FINITE)
                    row += 1
                touched[req.request_id] = None
        for group in plan.verify.values():
            self._verify(group)
            touched.update((req.request_id, None) for req, _ in group)

    def _verify(self, group: list[tuple[Request, list[int]]]) -> None:
        group = [(req, drafts) for req, drafts in group if not req.is_finished]  # a sibling failed earlier this step
        if not group:
            return
        reqs = [req for req, _ in group]
        ids = [[*req.token_range(req.num_tokens - 1, req.num_tokens), *drafts] for req, drafts in group]
        rows = [list(range(len(x))) for x in ids]
        logits, records = self.runner.run(reqs, ids, rows, verify=True)
        G = len(ids[0])
        logits_NGV = logits.view(len(group), G, -1)
        finite = _finite_rows(logits_NGV.flatten(1))  # per request: all G rows
        probs = _verify_probs([req for req, _ in group], logits_NGV, finite)
        emitted = []
        for n, (req, drafts) in enumerate(group):
            block = logits_NGV[n]
            if not finite[n]:
                emitted.append((req, [], None))  # folds nothing; the request ends below
                continue
            tokens, used = accept(block, probs[n], drafts, req.generator)
            emitted.append((req, tokens, block[used]))
            self.spec_stats.drafted += len(drafts)
            self.spec_stats.accepted += len(tokens) - 1
            self.proposer.update(req, len(drafts), len(tokens) - 1)
        self.spec_stats.steps += 1
        # Every emitted token but the last was an input of this pass: those are folded into the state.
        fold(self.manager.pools, [r.slot for r in reqs], records, [len(t) for _, t, _ in emitted])
        for req, tokens, rows in emitted:
            if req.is_finished:  # ended with a failed sibling in this loop
                continue
            if not tokens:
                self._fail(req, NON_FINITE)
                continue
            req.num_computed += len(tokens)
            self._emit(req, tokens, rows)  # first: the accepted drafts must be in req.tokens before commit hashes them
            if not req.is_finished:
                self.manager.commit(req)

    def _emit(self, req: Request, tokens: list[int], logits_GV: torch.Tensor) -> None:
        """Append sampled tokens (stopping early at a stop condition) and finish the request if one is met."""
        params = req.params
        logprobs_GV = F.log_softmax(logits_GV.float(), -1) if params.logprobs is not None else None
        for i, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if logprobs_GV is not None:
                lp = logprobs_GV[i]
                top = torch.topk(lp, params.logprobs) if params.logprobs else None
                entry = {tok: float(lp[tok])}
                if top is not None:
                    entry.update({int(t): float(v) for v, t in zip(top.values, top.indices)})
                req.output_logprobs.append(entry)
                req.cumulative_logprob += float(lp[tok])
            reason = self._stop_reason(req, tok)
            if reason is not None:
                req.finish_reason, req.stop_reason = reason
                self._finish(req)
                return

    def _stop_reason(self, req: Request, tok: int) -> tuple[str, str | int | None] | None:
        params = req.params
        req.detokenizer.append(tok)  # every token goes through the detokenizer, a stop token too
        if not params.ignore_eos and tok == self.eos_token_id:
            return "stop", tok
        if tok in params.stop_token_ids:
            return "stop", tok
        if params.stop:
            stop_string = req.detokenizer.find_stop()
            if stop_string is not None:
                return "stop", stop_string
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def _fail(self, req: Request, message: str) -> None:
        """End the request of `req` (all its samples) with finish_reason "error"; its resources are freed."""
        for sibling in self.requests.get(req.request_id, [req]):
            if not sibling.is_finished:
                sibling.finish_reason, sibling.error = "error", message
                self._finish(sibling)

    def _record_failure(self, message: str) -> None:
        self.failed_steps, self.last_failure, self.last_error = self.failed_steps + 1, time.monotonic(), message

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every open request with finish_reason "error" (the caller's last resort after an error outside a
        step's own containment; counted as a failure); returns their final outputs."""
        self._record_failure(message)
        touched = [rid for rid, reqs in self.requests.items() if not all(r.is_finished for r in reqs)]
        for rid in touched:
            self._fail(self.requests[rid][0], message)
        return [self._output(rid) for rid in touched]

    def _finish(self, req: Request) -> None:
        if self.manager.routes is not None:
            req.routed_experts = self.manager.read_routes(req)  # before finish releases its pages
        self.scheduler.finish(req)
        if self.proposer is not None:
            self.proposer.release(req)

    def _output(self, request_id: str) -> RequestOutput:
        reqs = self.requests[request_id]
        outs = []
        for req in reqs:
            outs.append(CompletionOutput(
                req.index, req.detokenizer.output(req.is_finished), list(req.output_token_ids),
                req.cumulative_logprob if req.params.logprobs is not None else None,
                list(req.output_logprobs) if req.params.logprobs is not None else None,
                req.finish_reason, req.stop_reason, req.error, routed_experts=req.routed_experts,
            ))  # fmt: skip
        return RequestOutput(
            request_id, self._prompts.get(request_id), reqs[0].prompt_token_ids, outs,
            all(r.is_finished for r in reqs), max(r.num_cached_tokens for r in reqs),
        )  # fmt: skip

    def release_finished(self, request_id: str) -> None:
        """Forget a finished request's records (the engine keeps them until the caller has read them)."""
        reqs = self.requests.get(request_id, [])
        if all(r.status is Status.FINISHED for r in reqs):
            self.requests.pop(request_id, None)
            self._prompts.pop(request_id, None)


class LLM:
    """Offline generation: `LLM(checkpoint_dir_or_model, **engine_options).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | os.PathLike | K3ForCausalLM | K3ForConditionalGeneration, tokenizer=None,
                 dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu", **options):  # fmt: skip
        """`dtype` as vLLM takes it (`resolve_dtype`: "auto", "bfloat16", "float32", "half", ..., or a torch dtype);
        None (the default) keeps the stored dtypes. A model object is converted in place when a dtype is given
        ("auto" leaves it as it is)."""
        self.checkpoint = None
        media_proc_cfg = None
        if isinstance(model, (str, os.PathLike)):
            self.checkpoint = model
            dtype, why = serving_dtype(dtype, model, device)
            log.info("LLM(%s): dtype %s (%s)", model, dtype, why)
            if K3Config.from_pretrained(model).vision_config is not None:
                model = K3ForConditionalGeneration.from_pretrained(model, dtype=dtype, device=device)
                media_proc_cfg = load_media_proc_cfg(self.checkpoint)
            else:
                model = K3ForCausalLM.from_pretrained(model, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.checkpoint, model.text_config)
        elif dtype is not None and not (isinstance(dtype, str) and dtype.lower() == "auto"):
            model.to_dtype(resolve_dtype(dtype))
        self.engine = LLMEngine(model, tokenizer, ServeConfig.from_options(**options), media_proc_cfg)
        self._chat_template = None
        self.max_image_pixels = DEFAULT_MAX_IMAGE_PIXELS  # per image part of `chat` (the server's default limit)

    @property
    def chat_template(self):
        """The checkpoint's chat format (`load_chat_template`); built from the tokenizer alone (K3's XTML when it
        has the markers, else plain) when the LLM was built from a model object. Made on first use."""
        if self._chat_template is None:
            self._chat_template = load_chat_template(self.checkpoint, self.engine.tokenizer)
        return self._chat_template

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tool_choice: str | dict | None = None,
        response_format: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (OpenAI message dicts) or a list of them, rendered in the chat format,
        generated, and each sample's `message` set to the parsed assistant message (K3's XTML format: content,
        reasoning_content, tool_calls; a plain or Jinja one: the text as content). The fields are checked as the
        server checks them (a ValueError naming the field); `finish_reason` stays the engine's ("stop", not
        "tool_calls"). With a vision checkpoint, user messages may hold image parts as the server takes them
        (`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`; nothing is fetched, each image
        at most `self.max_image_pixels`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        options = {"tools": tools, "tool_choice": tool_choice, "response_format": response_format,
                   "chat_template_kwargs": chat_template_kwargs}  # fmt: skip
        options = {k: v for k, v in options.items() if v is not None}
        requests = [chat_request({"messages": conv, **options}) for conv in conversations]
        template = self.chat_template
        params = sampling_params or SamplingParams()
        params = dataclasses.replace(params, stop=list(params.stop) + template.stop)
        outs = self.generate([self._chat_prompt(r, template) for r in requests], params, use_tqdm)
        for request, out in zip(requests, outs):
            for o in out.outputs:
                if not template.supports_tools:
                    o.message = {"role": "assistant", "content": o.text}
                    continue
                answer = request.answer(template, params.stop)
                answer.update(o.token_ids, finished=True)
                o.message = answer.message()
                answer.report(f"chat {out.request_id} sample {o.index}", o)
        return outs

    def _chat_prompt(self, request, template) -> dict:
        """The engine prompt of one chat request: its ids, and with image parts (data URLs, as the server takes
        them; each at most `max_image_pixels`) the decoded images behind K3's media markers."""
        images = request.image_parts()
        if not images:
            return {"prompt_token_ids": request.encode(template)}
        request.check_format(template)
        if self.engine.vision_model is None:
            raise FieldError(images[0].path, f"{images[0].path}: this model is text-only; image inputs need a "
                                             f"vision checkpoint")  # fmt: skip
        pil = [part.open(self.max_image_pixels) for part in images]
        ids = request.encode(template, [image_prompt(im) for im in pil])
        inputs = self.engine.process_images(pil, self.max_image_pixels)
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": inputs}}

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        final: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id not in final:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        self.last_elapsed_s = time.perf_counter() - start
        for rid in ids:
            engine.release_finished(rid)
        return [final[rid] for rid in ids]
