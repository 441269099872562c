"""POST /v1/chat/completions and GET /v1/chat/template: chat through the checkpoint's chat format (vLLM's
`serving_chat.py`).

In K3's XTML format (`template.supports_tools`) each sample's output ids are parsed (`ChatAnswer`) into
`reasoning_content`, `content` and `tool_calls`; `reasoning_content` is left out of a message, and of every stream
chunk, when the sample has none. A plain or Jinja format answers with the sample's text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from openk3.data.jinja_sandbox import TemplateFailed, TemplateRejected
from openk3.data.vision import image_prompt
from openk3.serve.chat_answer import ChatAnswer
from openk3.serve.config import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES_PER_REQUEST
from openk3.serve.protocol import ChatCompletionRequest, FieldError, ImagePart, chat_logprobs, new_id, now, usage
from openk3.serve.request import RequestOutput, SamplingParams
from openk3.serve.serving import APIError, Disconnected, OpenAIServing
from openk3.serve.streaming import TextStream


class OpenAIServingChat(OpenAIServing):
    def __init__(self, llm, models, template, preprocess=None,
                 max_images_per_request: int = DEFAULT_MAX_IMAGES_PER_REQUEST,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, **options):  # fmt: skip
        super().__init__(llm, models, preprocess, **options)
        self.template = template
        self.max_images_per_request, self.max_image_pixels = max_images_per_request, max_image_pixels

    def chat_template(self) -> dict:
        return {"name": self.template.name, "source": self.template.source}

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     is_disconnected: Disconnected = None) -> dict | AsyncIterator[str]:  # fmt: skip
        """The response body, or with `stream` the Server-Sent Events; an error response is an APIError."""
        self.models.check_model(req.model)
        try:
            req.check_format(self.template)
            images = req.image_parts()
        except FieldError as err:
            raise APIError(400, str(err), param=err.param) from err
        self._check_images(images)
        top = req.top_logprobs or 0
        try:
            params = req.sampling(req.requested_max_tokens or self.max_model_len, top if req.logprobs else None,
                                  self.template.stop)  # fmt: skip
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err
        run = _ChatRun(self, req, params, new_id("chatcmpl"), top)
        outputs = await self.start(lambda: self._prepare(lambda prompts: req.encode(self.template, prompts), images),
                                   params, run.rid)  # fmt: skip
        if not req.stream:
            return run.response(await self.final_output(outputs, is_disconnected))
        return self.sse(outputs, run.stream_of, run.usage_of, req.include_usage, run.rid, "chat.completion.chunk")

    def _check_images(self, images: list[ImagePart]) -> None:
        """What can be refused before any decoding: a text-only model, too many images, a URL that is not data."""
        if not images:
            return
        if self.engine.vision_model is None:
            raise APIError(400, f"{images[0].path}: this model is text-only; image inputs need a vision checkpoint",
                           param=images[0].path)  # fmt: skip
        if len(images) > self.max_images_per_request:
            raise APIError(400, f"messages: {len(images)} images exceed the limit of {self.max_images_per_request} "
                                f"per request", param="messages")  # fmt: skip
        for part in images:
            try:
                part.check_url()
            except FieldError as err:
                raise APIError(400, str(err), param=err.param) from err

    def _prepare(self, encode, images: list[ImagePart] = ()) -> dict:
        """The engine's prompt (runs in a preprocessing thread): the images opened and processed, the conversation
        rendered with their image prompts. `encode(image_prompts)` renders the request's messages."""
        try:
            if images:
                pil = [part.open(self.max_image_pixels) for part in images]
                try:
                    inputs = self.engine.process_images(pil, self.max_image_pixels)
                except ValueError as err:
                    raise APIError(400, f"messages: {err}", param="messages") from err
                ids = encode([image_prompt(im) for im in pil])
                return {"prompt_token_ids": ids, "multi_modal_data": {"image": inputs}}
            return {"prompt_token_ids": encode(None)}
        except FieldError as err:  # an image part that cannot be opened: the 400 names the part
            raise APIError(400, str(err), param=err.param) from err
        except TemplateRejected as err:
            raise APIError(400, str(err), param="messages") from err
        except TemplateFailed as err:
            raise APIError(500, str(err), "server_error") from err
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from err


class _ChatRun:
    """One chat request's response: its id, its log-prob count `top`, and in K3's format one ChatAnswer per sample
    (the non-streamed message, a stream's deltas and the usage's reasoning tokens all read it)."""

    def __init__(self, serving: OpenAIServingChat, req: ChatCompletionRequest, params: SamplingParams, rid: str,
                 top: int):  # fmt: skip
        self.serving, self.req, self.params, self.rid, self.top = serving, req, params, rid, top
        self.template = serving.template
        self.xtml = self.template.supports_tools
        self.answers: dict[int, ChatAnswer] = {}

    def answer_of(self, index: int) -> ChatAnswer:
        if index not in self.answers:
            self.answers[index] = self.req.answer(self.template, self.params.stop)
        return self.answers[index]

    def usage_of(self, out: RequestOutput) -> dict:
        reasoning = sum(a.result.reasoning_tokens for a in self.answers.values()) if self.xtml else None
        return usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens, reasoning)

    def body(self, choices: list[dict], kind: str = "chat.completion.chunk") -> dict:
        return {"id": self.rid, "object": kind, "created": now(), "model": self.serving.model_name, "choices": choices}

    def logprobs(self, o, start: int, end: int) -> dict | None:
        return chat_logprobs(o, start, end, self.top, self.serving.decode)

    def response(self, out: RequestOutput) -> dict:
        """The non-streamed response: one choice per sample, then the usage."""
        return {**self.body([self.choice(o) for o in out.outputs], "chat.completion"), "usage": self.usage_of(out)}

    def choice(self, o) -> dict:
        choice = {"index": o.index, "message": {"role": "assistant", "content": o.text},
                  "logprobs": self.logprobs(o, 0, len(o.token_ids)), "finish_reason": o.finish_reason}  # fmt: skip
        if self.xtml:
            answer = self.answer_of(o.index)
            answer.update(o.token_ids, finished=True)
            answer.report(f"{self.rid} choice {o.index}", o)
            message = answer.message()
            if message.get("reasoning_content") is None:  # absent when empty, as a stream never sends it
                del message["reasoning_content"]
            choice.update(message=message, finish_reason=answer.finish_reason(o.finish_reason))
        return choice

    def chunk(self, o, delta: dict, start: int, end: int, finish) -> dict:
        return self.body([{"index": o.index, "delta": delta, "finish_reason": finish,
                           "logprobs": self.logprobs(o, start, end) if end > start else None}])  # fmt: skip

    def stream_of(self, index: int):
        """Sample `index`'s stream: its opening chunk (the role), then its deltas."""
        opening = self.body([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                              "logprobs": None}])  # fmt: skip
        if self.xtml:
            return XTMLStream(self.rid, self.answer_of(index), self.chunk, opening)

        def text_chunk(o, text: str, start: int, end: int, finish) -> dict:
            return self.chunk(o, {"content": text} if text or finish is None else {}, start, end, finish)

        return TextStream(self.params.stop, text_chunk, opening)


class XTMLStream:
    """One sample's chat chunks in K3's format: one per parsed delta (`reasoning_content`, `content`, or a piece of
    a tool call), then an empty delta with the finish reason ("tool_calls" when the sample ended with calls)."""

    def __init__(self, rid: str, answer: ChatAnswer, chunk, opening: dict):
        self.rid, self.answer, self.chunk, self.sent, self.pending = rid, answer, chunk, 0, [opening]

    def __call__(self, o) -> list[dict]:
        bodies, self.pending = self.pending, []
        done, end = o.finish_reason is not None, len(o.token_ids)
        for delta in self.answer.update(o.token_ids, done):
            bodies.append(self.chunk(o, delta, self.sent, end, None))
            self.sent = end
        if done:
            self.answer.report(f"{self.rid} choice {o.index}", o)
            bodies.append(self.chunk(o, {}, self.sent, end, self.answer.finish_reason(o.finish_reason)))
        return bodies
