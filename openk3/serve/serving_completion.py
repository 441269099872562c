"""POST /v1/completions: text completion of a prompt given as text or token ids, streamed or not (vLLM's
`serving_completion.py`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from openk3.serve.protocol import CompletionRequest, completion_logprobs, new_id, now, usage
from openk3.serve.request import RequestOutput
from openk3.serve.serving import APIError, Disconnected, OpenAIServing
from openk3.serve.streaming import TextStream


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest,
                                is_disconnected: Disconnected = None) -> dict | AsyncIterator[str]:  # fmt: skip
        """The response body, or with `stream` the Server-Sent Events; an error response is an APIError."""
        self.models.check_model(req.model)
        try:
            params = req.sampling(req.max_tokens or self.max_model_len, req.logprobs, [])
        except ValueError as err:
            raise APIError(400, str(err)) from err
        rid = new_id("cmpl")
        outputs = await self.start(lambda: self._prepare(req.prompt), params, rid)
        top = req.logprobs or 0
        if not req.stream:
            out = await self.final_output(outputs, is_disconnected)
            choices = [{"index": o.index, "text": o.text, "finish_reason": o.finish_reason,
                        "logprobs": completion_logprobs(o, 0, len(o.token_ids), top, self.decode)}
                       for o in out.outputs]  # fmt: skip
            return {**self._body(rid, choices), "usage": _usage(out)}

        def chunk(o, text: str, start: int, end: int, finish) -> dict:
            choice = {"index": o.index, "text": text, "finish_reason": finish,
                      "logprobs": completion_logprobs(o, start, end, top, self.decode)}  # fmt: skip
            return self._body(rid, [choice])

        return self.sse(outputs, lambda _index: TextStream(params.stop, chunk), _usage, req.include_usage, rid,
                        "text_completion")  # fmt: skip

    def _prepare(self, prompt) -> dict:
        """The engine's prompt: token ids as given, or the text and its ids (text that cannot be tokenized: 400)."""
        if not isinstance(prompt, str):
            return {"prompt_token_ids": prompt}
        try:
            return {"prompt": prompt, "prompt_token_ids": self.engine.encode_prompt(prompt)}
        except ValueError as err:
            raise APIError(400, str(err), param="prompt") from err

    def _body(self, rid: str, choices: list[dict]) -> dict:
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name, "choices": choices}


def _usage(out: RequestOutput) -> dict:
    return usage(len(out.prompt_token_ids), out.outputs, out.num_cached_tokens)
