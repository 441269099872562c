"""K3Config: the released `config.json`, field for field, plus the layer schedule and the presets.

The dataclasses mirror the official JSON: a top-level `K3Config` (model_type `kimi_k3`) holding a `K3TextConfig`
(model_type `kimi_linear`) with its nested `LinearAttnConfig` and optional `QuantizationConfig`; the `vision_config` is
kept as plain data (it round-trips as read; model/vision.py's `VisionConfig` reads the fields the tower uses). Unknown
keys are kept in `extra` so that `from_pretrained` -> `save_pretrained` reproduces the official file byte for byte.

Layer schedule (0-based layer l): KDA iff l + 1 is in `linear_attn_config.kda_layers`, MLA iff l + 1 is in
`full_attn_layers`; dense FFN iff l < first_k_dense_replace (or off the MoE frequency); an AttnRes block starts at every
l % attn_res_block_size == 0.

Reading checks every JSON value against its field's type (integers are never bools or floats), and `validate` bounds
every size (`_TEXT_SIZES`, `_KDA_SIZES`) before anything is sized from it. Errors name the field (dotted, as
`text_config.linear_attn_config.num_heads`); `from_pretrained` adds the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from openk3.utils import FP32_EXP_LIMIT, file_inside, read_json

# A 16-token tile anchored before its first token keeps e^{16|L|} finite in fp32 iff 16 * |L| < FP32_EXP_LIMIT.
_KDA_TILE = 16

# Inclusive (min, max) of every integer size, checked before anything is built from it (a typo'd 10**9 layers would
# otherwise fill memory in `validate` itself). The maxima are generous next to the release's values (in comments).
_MAX_LAYERS = 10_000
_TEXT_SIZES = {
    "vocab_size": (1, 2**24),  # 163840
    "hidden_size": (1, 2**17),  # 7168
    "num_hidden_layers": (1, _MAX_LAYERS),  # 93
    "intermediate_size": (0, 2**20),  # 33792; positive if a layer is dense (checked below)
    "num_attention_heads": (1, 4096),  # 96
    "num_key_value_heads": (1, 4096),  # 96
    "q_lora_rank": (1, 2**17),  # 1536
    "kv_lora_rank": (1, 2**17),  # 512
    "qk_nope_head_dim": (1, 4096),  # 128
    "qk_rope_head_dim": (0, 4096),  # 64
    "v_head_dim": (1, 4096),  # 128
    "attn_res_block_size": (1, _MAX_LAYERS),  # 12
    "max_position_embeddings": (1, 2**31 - 1),  # 1048576
    "num_experts": (1, 2**16),  # 896
    "num_experts_per_token": (1, 2**16),  # 16
    "num_shared_experts": (0, 1024),  # 2
    "moe_intermediate_size": (1, 2**20),  # 3072
    "routed_expert_hidden_size": (1, 2**17),  # 3584, the latent width of the routed experts
    "num_expert_group": (1, 2**16),  # 1
    "topk_group": (1, 2**16),  # 1
    "first_k_dense_replace": (0, _MAX_LAYERS),  # 1
    "moe_layer_freq": (1, _MAX_LAYERS),  # 1
    "num_nextn_predict_layers": (0, _MAX_LAYERS),  # 0
}
_KDA_SIZES = {"num_heads": (1, 4096), "head_dim": (1, 4096), "short_conv_kernel_size": (1, 1024)}  # 96, 128, 4


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if not _is_int(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {_show(value)}")


# What a JSON value must be for each field annotation (`X | None` also takes null); other annotations are not checked.
_JSON_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "int": ("an integer", _is_int),
    "float": ("a finite number", lambda v: _is_int(v) or (isinstance(v, float) and math.isfinite(v))),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list[int]": ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))),
    "list[str]": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "dict[str, Any]": ("a JSON object", lambda v: isinstance(v, dict)),
    "dict[str, str]": ("a JSON object", lambda v: isinstance(v, dict)),
}


class _JsonSection:
    """Mixin for the config dataclasses: JSON dict <-> dataclass. Keys that are not fields go to `extra` (kept for
    round trips); fields named in `_NESTED` hold another section; `omit_if_none` fields are left out when None."""

    _NESTED: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = ""):
        """`where` is the section's dotted name in errors ("" at the top, then "text_config", ...)."""
        if not isinstance(data, dict):
            raise ValueError(f"{where or 'config'} must be a JSON object, got {_show(data)}")
        annotations = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "extra"}
        kwargs = {}
        for key, value in data.items():
            if key not in annotations:
                continue
            name, annotation = f"{where}.{key}" if where else key, annotations[key]
            if value is None and annotation.endswith(" | None"):
                pass
            elif key in cls._NESTED:
                value = cls._NESTED[key].from_dict(value, name)
            elif annotation.removesuffix(" | None") in _JSON_TYPES:
                expected, ok = _JSON_TYPES[annotation.removesuffix(" | None")]
                if not ok(value):
                    raise ValueError(f"{name} must be {expected}, got {_show(value)}")
            kwargs[key] = value
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in annotations})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.metadata.get("omit_if_none")):
                continue
            out[f.name] = value.to_dict() if isinstance(value, _JsonSection) else value
        out.update(self.extra)
        return out


@dataclass
class LinearAttnConfig(_JsonSection):
    """`text_config.linear_attn_config`: the KDA layers. Layer lists are 1-based, as in the released file."""

    num_heads: int = 96
    head_dim: int = 128
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float = -5.0
    full_attn_layers: list[int] = field(default_factory=lambda: [*range(4, 93, 4), 93])
    kda_layers: list[int] = field(default_factory=lambda: [i for i in range(1, 92) if i % 4])
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class QuantizationConfig(_JsonSection):
    """`text_config.quantization_config` (compressed-tensors). Only MXFP4 routed experts exist in K3."""

    quant_method: str = "compressed-tensors"
    format: str = "mxfp4-pack-quantized"
    quantization_status: str = "compressed"
    config_groups: dict[str, Any] = field(
        default_factory=lambda: {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.uint8",
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        }
    )
    ignore: list[str] = field(
        default_factory=lambda: [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ]
    )
    kv_cache_scheme: Any = None
    global_compression_ratio: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_mxfp4(self) -> bool:
        return self.format == "mxfp4-pack-quantized"

    def validate(self) -> None:
        if self.quant_method != "compressed-tensors" or not self.is_mxfp4:
            raise ValueError(
                f"quantization_config: only compressed-tensors 'mxfp4-pack-quantized' is supported, got "
                f"quant_method={self.quant_method!r} format={self.format!r}"
            )
        for name, group in self.config_groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            need = {"num_bits": 4, "group_size": 32, "type": "float"}
            if not isinstance(weights, dict) or any(weights.get(k) != v for k, v in need.items()):
                raise ValueError(
                    f"quantization_config.config_groups.{name}.weights: MXFP4 needs num_bits=4, group_size=32, "
                    f"type='float'; got {weights}"
                )


@dataclass
class K3TextConfig(_JsonSection):
    """`text_config`: the language model. Defaults are the released K3 values."""

    _NESTED: ClassVar[dict[str, type]] = {
        "linear_attn_config": LinearAttnConfig,
        "quantization_config": QuantizationConfig,
    }

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    intermediate_size: int = 33792
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    hidden_act: str = "situ"
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "noaux_tc"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    use_cache: bool = True
    dtype: str = "bfloat16"
    model_type: str = "kimi_linear"
    architectures: list[str] = field(default_factory=lambda: ["KimiLinearForCausalLM"])
    # The release's auto_map names its modeling files (modeling_kimi_k3.py, ...), which a folder we write does not
    # hold: a config read from a release keeps its own (so it round-trips byte for byte), one we build has none.
    auto_map: dict[str, str] | None = field(default=None, metadata={"omit_if_none": True})
    transformers_version: str = "4.56.2"
    linear_attn_config: LinearAttnConfig = field(default_factory=LinearAttnConfig)
    quantization_config: QuantizationConfig | None = field(default=None, metadata={"omit_if_none": True})
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # Layer schedule; everything else derives from these three functions.
    def layer_kind(self, layer: int) -> str:
        """ "kda" or "mla" for 0-based `layer`."""
        return "kda" if layer + 1 in self._kda_set else "mla"

    def ffn_kind(self, layer: int) -> str:
        """ "dense" or "moe" for 0-based `layer` (the released rule: MoE iff l >= first_k_dense_replace and
        l % moe_layer_freq == 0)."""
        return "moe" if layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0 else "dense"

    def is_block_start(self, layer: int) -> bool:
        """True where a Block AttnRes block starts: the incoming partial sum is appended to the bank."""
        return layer % self.attn_res_block_size == 0

    @property
    def _kda_set(self) -> set[int]:
        return set(self.linear_attn_config.kda_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts are stored fused as one SiTU MLP of this width."""
        return self.num_shared_experts * self.moe_intermediate_size

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field. Sizes and layer lists are checked first, before
        anything (here, the layer sets) is built from them."""
        la = self.linear_attn_config
        for name, (lo, hi) in _TEXT_SIZES.items():
            _check_int(f"text_config.{name}", getattr(self, name), lo, hi)
        for name, (lo, hi) in _KDA_SIZES.items():
            _check_int(f"text_config.linear_attn_config.{name}", getattr(la, name), lo, hi)
        for name in ("kda_layers", "full_attn_layers"):
            ids = getattr(la, name)
            if not isinstance(ids, (list, tuple)) or not all(map(_is_int, ids)):
                raise ValueError(f"text_config.linear_attn_config.{name} must be a list of integers, got {_show(ids)}")
        if (
            any(self.ffn_kind(layer) == "dense" for layer in range(self.num_hidden_layers))
            and self.intermediate_size <= 0
        ):
            raise ValueError(f"text_config.intermediate_size must be positive, got {self.intermediate_size!r}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"text_config.num_experts_per_token ({self.num_experts_per_token}) exceeds "
                f"num_experts ({self.num_experts})"
            )
        if not self.latent_moe_use_norm:
            raise ValueError("text_config.latent_moe_use_norm must be true (Stable LatentMoE normalises after the sum)")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                f"text_config.num_key_value_heads ({self.num_key_value_heads}) must equal num_attention_heads "
                f"({self.num_attention_heads}): K3's MLA has one latent per token and no GQA"
            )
        if not self.mla_use_nope:
            raise ValueError("text_config.mla_use_nope must be true: K3's MLA applies no rotary embedding")
        if self.hidden_act != "situ":
            raise ValueError(f"text_config.hidden_act: only 'situ' is supported, got {self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(
                f"text_config.moe_router_activation_func: only 'sigmoid', got {self.moe_router_activation_func!r}"
            )
        if self.topk_method != "noaux_tc":
            raise ValueError(f"text_config.topk_method: only 'noaux_tc' is supported, got {self.topk_method!r}")
        if self.num_expert_group != 1 or self.topk_group != 1:
            raise ValueError(
                f"text_config.num_expert_group/topk_group: group-limited routing is not used by K3, "
                f"got {self.num_expert_group}/{self.topk_group}"
            )
        if self.num_nextn_predict_layers != 0:
            raise ValueError("text_config.num_nextn_predict_layers: MTP layers are not supported (K3 ships none)")
        if self.tie_word_embeddings:
            raise ValueError("text_config.tie_word_embeddings must be false: K3's lm_head is a separate matrix")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            token = getattr(self, name)
            if token is not None and not (_is_int(token) and 0 <= token < self.vocab_size):
                raise ValueError(f"text_config.{name} ({token!r}) is outside the vocabulary of {self.vocab_size}")
        if not la.use_full_rank_gate:
            raise ValueError(
                "text_config.linear_attn_config.use_full_rank_gate must be true (K3's g_proj is full rank)"
            )
        if not (la.gate_lower_bound < 0 and _KDA_TILE * abs(la.gate_lower_bound) < FP32_EXP_LIMIT):
            raise ValueError(
                f"text_config.linear_attn_config.gate_lower_bound ({la.gate_lower_bound}) must be negative with "
                f"16 * |bound| < {FP32_EXP_LIMIT} so the dense 16-token KDA tiles stay finite in fp32"
            )
        all_layers = set(range(1, self.num_hidden_layers + 1))
        kda, full = list(la.kda_layers), list(la.full_attn_layers)
        for name, ids in (("kda_layers", kda), ("full_attn_layers", full)):
            if len(set(ids)) != len(ids):
                raise ValueError(f"text_config.linear_attn_config.{name} lists a layer twice: {sorted(ids)}")
            outside = sorted(set(ids) - all_layers)
            if outside:
                raise ValueError(
                    f"text_config.linear_attn_config.{name} has layers {outside} outside 1..{self.num_hidden_layers}"
                )
        both = sorted(set(kda) & set(full))
        if both:
            raise ValueError(
                f"text_config.linear_attn_config: layers {both} are in both kda_layers and full_attn_layers"
            )
        missing = sorted(all_layers - set(kda) - set(full))
        if missing:
            raise ValueError(
                f"text_config.linear_attn_config: layers {missing} are in neither kda_layers nor full_attn_layers"
            )
        if self.quantization_config is not None:
            self.quantization_config.validate()


@dataclass
class K3Config(_JsonSection):
    """The top-level `config.json` of a K3 checkpoint (model_type `kimi_k3`)."""

    _NESTED: ClassVar[dict[str, type]] = {"text_config": K3TextConfig}

    text_config: K3TextConfig = field(default_factory=K3TextConfig)
    vision_config: dict[str, Any] | None = field(default=None, metadata={"omit_if_none": True})
    architectures: list[str] = field(default_factory=lambda: ["KimiK3ForConditionalGeneration"])
    # The release's auto_map names its modeling files (modeling_kimi_k3.py, ...), which a folder we write does not
    # hold: a config read from a release keeps its own (so it round-trips byte for byte), one we build has none.
    auto_map: dict[str, str] | None = field(default=None, metadata={"omit_if_none": True})
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    dtype: str = "bfloat16"
    ignore_index: int = -100
    image_placeholder: str = "<|kimi_image_placeholder|>"
    media_placeholder_token_id: int = 163605
    model_type: str = "kimi_k3"
    tie_word_embeddings: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> K3Config:
        if not isinstance(data, dict):
            raise ValueError(f"config must be a JSON object, got {_show(data)}")
        if "text_config" not in data:
            raise ValueError("config: no 'text_config' (expected a kimi_k3 config.json with a nested text_config)")
        if data.get("model_type", "kimi_k3") != "kimi_k3":
            raise ValueError(f"config.model_type: expected 'kimi_k3', got {data.get('model_type')!r}")
        try:
            return super().from_dict(data)
        except TypeError as err:  # a field of the wrong JSON type surfaces as a TypeError inside the dataclasses
            raise ValueError(f"config: {err}") from err

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> K3Config:
        """Read `config.json` from a checkpoint folder (or the file itself); errors name the file."""
        path = os.fspath(path)
        file = file_inside(path, "config.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise FileNotFoundError(f"no config.json at {file}")
        data = read_json(file)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from err

    def to_json_string(self) -> str:
        # The exact layout transformers writes (sorted keys, 2-space indent, trailing newline).
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write `config.json` into folder `path` atomically (temp file + rename)."""
        os.makedirs(path, exist_ok=True)
        file = os.path.join(path, "config.json")
        tmp = file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
        os.replace(tmp, file)

    @classmethod
    def preset(cls, name: str) -> K3Config:
        """One of `PRESETS`: "k3" (the release), "small" (100-300M), "tiny" (<10M, CPU-trainable)."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return PRESETS[name]()


def _vision_config_k3() -> dict[str, Any]:
    """The released MoonViT-V2 settings, as the release's config.json holds them."""
    return {
        "_attn_implementation": "flash_attention_2",
        "activation_func": "gelu_pytorch_tanh",
        "attn_bias": False,
        "init_pos_emb_height": 64,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": 64,
        "linear_bias": False,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "mm_hidden_size": 1024,
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "patch_embed_proj_bias": False,
        "patch_size": 14,
        "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "qkv_hidden_size": 1536,
        "text_hidden_size": 7168,
        "vt_hidden_size": 1024,
        "vt_intermediate_size": 4096,
        "vt_num_attention_heads": 12,
        "vt_num_hidden_layers": 27,
    }


def _hybrid_layers(num_layers: int, every: int = 4) -> tuple[list[int], list[int]]:
    """K3's schedule scaled to `num_layers` as 1-based (full_attn_layers, kda_layers): MLA at every `every`-th layer
    and at the last layer, KDA elsewhere."""
    full = sorted({*range(every, num_layers + 1, every), num_layers})
    return full, [i for i in range(1, num_layers + 1) if i not in full]


def _scaled(
    *, vocab: int, hidden: int, layers: int, heads: int, head_dim: int, q_rank: int, kv_rank: int, rope: int,
    dense: int, experts: int, top_k: int, expert_hidden: int, latent: int, block: int, special_base: int,
) -> K3Config:  # fmt: skip
    full, kda = _hybrid_layers(layers)
    bos, eos, pad = special_base, special_base + 2, vocab - 1
    text = K3TextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=dense,
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=q_rank, kv_lora_rank=kv_rank,
        qk_nope_head_dim=head_dim, qk_rope_head_dim=rope, v_head_dim=head_dim, attn_res_block_size=block,
        num_experts=experts, num_experts_per_token=top_k, num_shared_experts=2,
        moe_intermediate_size=expert_hidden, routed_expert_hidden_size=latent,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        linear_attn_config=LinearAttnConfig(num_heads=heads, head_dim=head_dim, full_attn_layers=full, kda_layers=kda),
    )  # fmt: skip
    return K3Config(text_config=text, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                    media_placeholder_token_id=special_base + 21)  # fmt: skip


def preset_k3() -> K3Config:
    """The released Kimi K3 text model (2.78T total, 104.2B active), with its MXFP4 quantization config."""
    return K3Config(
        text_config=K3TextConfig(quantization_config=QuantizationConfig()), vision_config=_vision_config_k3()
    )


def preset_tiny() -> K3Config:
    """< 10M parameters, trains on CPU in minutes, every mechanism present: dense layer 0, 8 routed experts top-2 in
    a latent space, a shared MLP, 3 AttnRes blocks, MLA at layers 4, 8 and the last (9), KDA elsewhere.
    The vocabulary mirrors K3's layout: 768 base ranks (a trained BPE, or bytes 0-255 for the byte-level fallback)
    followed by 256 special ids (bos 768, eos 770, pad 1023)."""
    return _scaled(vocab=1024, hidden=192, layers=9, heads=3, head_dim=64, q_rank=96, kv_rank=64, rope=32,
                   dense=512, experts=8, top_k=2, expert_hidden=128, latent=96, block=3, special_base=768)  # fmt: skip


def preset_small() -> K3Config:
    """228.6M parameters total (104.3M active): K3's shape at 768 wide, 13 layers, 32 experts top-4."""
    return _scaled(vocab=32768, hidden=768, layers=13, heads=6, head_dim=128, q_rank=384, kv_rank=256, rope=64,
                   dense=2048, experts=32, top_k=4, expert_hidden=256, latent=384, block=4, special_base=32512)  # fmt: skip


def preset_medium() -> K3Config:
    """418.2M parameters total (243.1M active): K3's shape at 1024 wide, 16 layers, 16 experts top-4 in a 512 latent;
    the checkpoint shape of the CPU inference comparison with llama.cpp (`k3 bench cpu`, docs/cpu.md)."""
    return _scaled(vocab=32768, hidden=1024, layers=16, heads=8, head_dim=128, q_rank=512, kv_rank=256, rope=64,
                   dense=5120, experts=16, top_k=4, expert_hidden=512, latent=512, block=4, special_base=32512)  # fmt: skip


def preset_tiny_vl() -> K3Config:
    """`tiny` plus a small MoonViT-V2 that trains on 2 CPU cores (1.93M tower + 0.74M projector parameters, 8.98M
    in all): the release's vision_config keys and implemented types, scaled to width 192, 4 blocks of 3 heads x 64
    (qkv width = width), MLP 768, patch 14, 2x2 merge, a 16x16 position table (grids up to 224 px without
    interpolation), and the projector to the text width 192. The media placeholder is special base + 21 (id 789).
    The tower can be this wide because it is cheap: images of the embedded tasks have 16-64 patches, and the text
    model's tokens cost far more per step."""
    config = preset_tiny()
    config.vision_config = {**_vision_config_k3(), "init_pos_emb_height": 16, "init_pos_emb_width": 16,
                            "mm_hidden_size": 192, "qkv_hidden_size": 192, "text_hidden_size": 192,
                            "vt_hidden_size": 192, "vt_intermediate_size": 768, "vt_num_attention_heads": 3,
                            "vt_num_hidden_layers": 4}  # fmt: skip
    return config


PRESETS = {
    "k3": preset_k3,
    "medium": preset_medium,
    "small": preset_small,
    "tiny": preset_tiny,
    "tiny-vl": preset_tiny_vl,
}
# The presets the text-only commands (k3 init/plan/tokenizer) offer: tiny-vl is built with K3ForConditionalGeneration,
# and only `k3 train` (--data vision) feeds it images.
TEXT_PRESETS = tuple(sorted(name for name in PRESETS if name != "tiny-vl"))
