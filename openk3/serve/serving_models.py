"""GET /v1/models: the one served model, and the check that a request names it (vLLM's `serving_models.py`)."""

from __future__ import annotations

from openk3.serve.protocol import now
from openk3.serve.serving import APIError


class OpenAIServingModels:
    def __init__(self, model_name: str, max_model_len: int):
        self.model_name, self.max_model_len = model_name, max_model_len

    def show_available_models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": now(), "owned_by": "openk3",
                "max_model_len": self.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    def check_model(self, name: str | None) -> None:
        """A request naming another model is a 404 (no `model` field: the served one)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`",
                           "not_found_error", "model")  # fmt: skip
