"""ServeConfig: every engine option in one dataclass, with vLLM's names where vLLM has one.

Units (tokens): the hash unit U (prefix matching granularity, default 512) and the allocation unit B (one MLA page,
a multiple of U; K3 uses 1024-6144 on GPUs: serve/plan.py). Budgets: `max_num_batched_tokens` per engine step (chunked
prefill and decode share it), `max_num_seqs` running requests (= KDA working slots), `num_blocks` MLA pages and
`max_num_checkpoints` KDA state checkpoints. Derived defaults are filled in one place, `resolve`. For RL rollouts:
`record_routed_experts` (routes per token) and `CheckpointPolicy.output_end` (agent-loop turns resume near the
previous turn's output end).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from openk3.utils import read_json

# The HTTP server's per-request limits (`k3 serve` flags; docs/serving.md "Limits").
DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # --max-body-bytes: larger bodies get 413 before they are read
DEFAULT_PREPROCESS_TIMEOUT_S = 30.0  # --preprocess-timeout: tokenizing + templating one prompt
DEFAULT_MAX_IMAGES_PER_REQUEST = 8  # --max-images-per-request: image content parts in one chat request
DEFAULT_MAX_IMAGE_PIXELS = 16 * 2**20  # --max-image-pixels: W x H of one image, checked from its header
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0  # --shutdown-timeout: SIGTERM drain before running requests are failed


# vLLM's dtype names (its `_STR_DTYPE_TO_TORCH_DTYPE`, case-insensitive), plus "auto".
VLLM_DTYPES = {"half": torch.float16, "float16": torch.float16, "float": torch.float32, "float32": torch.float32,
               "bfloat16": torch.bfloat16}  # fmt: skip
DTYPE_CHOICES = ("auto", *VLLM_DTYPES)


def resolve_dtype(dtype: str | torch.dtype | None, config_dtype: str | torch.dtype | None = None) -> torch.dtype | None:
    """`LLM(dtype=...)` / `k3 serve --dtype` as vLLM reads them: a torch dtype (fp32, bf16, fp16), one of
    `VLLM_DTYPES` (any case), or "auto": the checkpoint's config dtype (`config_dtype`, from config.json's "dtype" or
    "torch_dtype"), with a float32 (or absent) one served as bfloat16, as vLLM's CPU platform resolves it (bf16 is
    its preferred dtype). None, openk3's default, keeps each tensor's stored dtype (training checkpoints: fp32).
    Anything else is a ValueError naming `dtype` and the accepted values."""
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        if dtype not in VLLM_DTYPES.values():
            raise ValueError(f"dtype {dtype} is not served; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if not isinstance(dtype, str) or dtype.lower() not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not one of {list(DTYPE_CHOICES)} (vLLM's names) or a torch.dtype")
    name = dtype.lower()
    if name != "auto":
        return VLLM_DTYPES[name]
    if isinstance(config_dtype, str):
        config_dtype = VLLM_DTYPES.get(config_dtype.removeprefix("torch.").lower())  # unknown names: as if absent
    return torch.bfloat16 if config_dtype in (None, torch.float32) else config_dtype


def checkpoint_fp32_bytes(path) -> int | None:
    """The bytes of a checkpoint's parameters in fp32 (its config's model built on the meta device); None where its
    config cannot be read (a training run's folder, a damaged file: the loader reports those)."""
    from openk3.config import K3Config
    from openk3.model.model import K3ForCausalLM
    from openk3.model.multimodal import K3ForConditionalGeneration

    try:
        config = K3Config.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    with torch.device("meta"):
        model = (K3ForConditionalGeneration if config.vision_config is not None else K3ForCausalLM)(config)
    return 4 * sum(p.numel() for p in model.parameters())


def serving_dtype(
    dtype: str | torch.dtype | None, path, device: str | torch.device = "cpu"
) -> tuple[torch.dtype | None, str]:
    """The dtype to load checkpoint `path` in on `device`, and why: `resolve_dtype`, and for "auto" the CPU rule of
    `ops.widen.auto_dtype` (a bf16 checkpoint on a CPU without bf16 arithmetic computes in fp32 where its widened
    weights fit in memory, else stays bf16 with every product widened tile by tile)."""
    from openk3.ops.widen import auto_dtype

    auto = isinstance(dtype, str) and dtype.lower() == "auto"
    resolved = resolve_dtype(dtype, checkpoint_dtype(path) if auto else None)
    if not auto:
        return resolved, "as asked" if dtype is not None else "the stored dtypes"
    return auto_dtype(resolved, device, checkpoint_fp32_bytes(path))


def checkpoint_dtype(path) -> str | None:
    """The dtype a checkpoint's config.json declares ("dtype", else "torch_dtype"; the text config's if the top
    level has none); None if it declares none."""
    file = os.path.join(path, "config.json")
    data = read_json(file) if os.path.isfile(file) else {}
    for section in (data, data.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(section.get(key), str):
                return section[key]
    return None


@dataclass
class CheckpointPolicy:
    """Which hash endpoints get a KDA state checkpoint (see docs/serving.md). Positions are unit boundaries."""

    prompt_end: bool = True  # the last unit boundary <= len(prompt) - 1
    interval: int = 32768  # tokens between checkpoints during long prefills (a multiple of U; 0 = off)
    second_sighting: bool = True  # latents matched deeper than any checkpoint: plant one at the matched depth
    # While a request decodes, a checkpoint at each unit boundary it reaches, keeping only its latest one: the next
    # turn of an agent loop (prompt = this prompt + output + observation) resumes near the end of this output.
    output_end: bool = False


@dataclass
class SpeculativeConfig:
    """`{"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...}` as in vLLM."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # n-gram lengths tried, longest first (vLLM's names)
    prompt_lookup_min: int = 3
    model: Any = None  # draft_model: a checkpoint folder or a K3ForCausalLM sharing the target's vocabulary

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model is required for method 'draft_model'")


@dataclass
class ServeConfig:
    max_model_len: int | None = None  # default: the model's max_position_embeddings, at most 32768
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True  # on by default: users must not have to know to enable it
    hash_unit: int = 512
    block_size: int = 1024  # the allocation unit B
    num_blocks: int | None = None  # default: every running request at max_model_len, within `cache_memory_bytes`
    cache_memory_bytes: int = 2**30  # the MLA page budget used to size the default num_blocks
    max_num_checkpoints: int | None = None  # default: 2 per running request
    checkpoint_policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    speculative_config: SpeculativeConfig | None = None
    # Fill freed state slots and freed pages with NaN so any read of unwritten memory poisons the logits (reading a
    # never-written slot is a silent-corruption bug public engines have shipped). Costs one fill per free; on by
    # default because silent corruption is the worse failure.
    poison_free: bool = True
    # Record every fed token's routed experts per MoE layer (kv/routes.py) and return them with each finished
    # request (`CompletionOutput.routed_experts`), for routing replay in RL training (docs/rl.md).
    record_routed_experts: bool = False

    @classmethod
    def from_options(cls, **options: Any) -> ServeConfig:
        """Engine options as keyword arguments (vLLM's `LLM(model, **options)`); unknown names are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        if isinstance(options.get("speculative_config"), dict):
            options["speculative_config"] = SpeculativeConfig(**options["speculative_config"])
        if isinstance(options.get("checkpoint_policy"), dict):
            options["checkpoint_policy"] = CheckpointPolicy(**options["checkpoint_policy"])
        return cls(**options)

    def resolve(self, model_max_len: int, page_bytes: int) -> ServeConfig:
        """Check the options and fill the derived defaults; warns when prefix caching is configured to be inert.
        `page_bytes`: one MLA page (block_size tokens, every MLA layer)."""
        if self.max_model_len is None:
            self.max_model_len = min(model_max_len, 32768)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "hash_unit", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size % self.hash_unit:
            raise ValueError(f"block_size {self.block_size} must be a multiple of hash_unit {self.hash_unit}")
        interval = self.checkpoint_policy.interval
        if interval < 0 or interval % self.hash_unit:
            raise ValueError(f"checkpoint_policy.interval {interval} must be a non-negative multiple of hash_unit")
        # One request at max_model_len (plus drafts), plus the copy-on-write pins of a prefix hit.
        blocks_per_seq = math.ceil((self.max_model_len + self._spec_tokens) / self.block_size)
        min_blocks = blocks_per_seq + (self.block_size // self.hash_unit if self.enable_prefix_caching else 0)
        if self.num_blocks is None:
            affordable = self.cache_memory_bytes // max(page_bytes, 1)
            self.num_blocks = max(min_blocks, min(self.max_num_seqs * blocks_per_seq, affordable))
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"num_blocks {self.num_blocks} cannot hold one request of max_model_len {self.max_model_len} in pages "
                f"of {self.block_size} tokens (needs {min_blocks}, counting the pages a prefix hit may pin)"
            )
        if self.max_num_checkpoints is None:
            self.max_num_checkpoints = 2 * self.max_num_seqs if self.enable_prefix_caching else 0
        if self.max_num_checkpoints < 0:
            raise ValueError(f"max_num_checkpoints must be non-negative, got {self.max_num_checkpoints}")
        if self.max_num_batched_tokens < 1 + self._spec_tokens:
            raise ValueError("max_num_batched_tokens must hold one verify step (1 + num_speculative_tokens)")
        if self.enable_prefix_caching:
            self._warn_if_inert()
        return self

    @property
    def _spec_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config else 0

    def _warn_if_inert(self) -> None:
        """Startup checks: configurations under which prefix caching can never (or rarely) hit."""
        policy = self.checkpoint_policy
        any_policy = policy.prompt_end or policy.interval or policy.second_sighting or policy.output_end
        if not any_policy or self.max_num_checkpoints == 0:
            warnings.warn("prefix caching is inert: no KDA state checkpoint can ever be taken", stacklevel=3)
        if self.hash_unit >= self.max_model_len:
            warnings.warn(
                f"prefix caching is inert: hash_unit {self.hash_unit} >= max_model_len {self.max_model_len}",
                stacklevel=3,
            )
        if self.max_num_batched_tokens % self.hash_unit and self.max_num_batched_tokens > self.hash_unit:
            warnings.warn(
                f"max_num_batched_tokens {self.max_num_batched_tokens} is not a multiple of hash_unit "
                f"{self.hash_unit}: prefill chunks are cut at unit boundaries, so part of each step's budget "
                "goes unused",
                stacklevel=3,
            )
