"""GET /health and GET /metrics: whether the engine loop runs, and the Prometheus text (serve/metrics.py)."""

from __future__ import annotations

from openk3.serve.async_engine import AsyncLLM
from openk3.serve.serving import APIError


class OpenAIServingHealth:
    def __init__(self, llm: AsyncLLM):
        self.llm = llm

    def health(self) -> dict:
        """{"status": "ok" | "degraded", ...} while the engine loop runs; a 503 naming the error when it does not."""
        body = self.llm.health()
        if body["status"] == "dead":
            raise APIError(503, body["error"], "server_error")
        return body

    def metrics(self) -> bytes:
        """Prometheus text exposition."""
        return self.llm.metrics.render()
