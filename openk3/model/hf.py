"""The official checkpoint format: the only file that knows the released tensor names (spec/model.md §8-10).

Our parameter names equal the checkpoint's after the prefix `language_model.`, except for:
- routed experts: we stack them (`...experts.w1` [E, F, Lt]); the checkpoint has one tensor per expert,
  `...experts.{e}.w1.weight` (plain) or `...experts.{e}.w1.weight_packed` + `.weight_scale` (MXFP4, uint8);
- `A_log`: we hold [H]; the checkpoint pads it with zeros to head_dim entries (96 -> 128 in the release);
  loading accepts any length >= H whose extra entries are exactly zero.
Vision tensors (`vision_tower.*`, `mm_projector.*`, spec/vision.md §2) have our names exactly, in
`K3ForConditionalGeneration` (model/multimodal.py), and keep their stored dtypes (bf16 in the release); the text
model `K3ForCausalLM` skips them with a notice.

Files: `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json`.
Pickle files (.bin/.pt/.pth/.ckpt) are refused and never opened: unpickling can run arbitrary code. Every file a
checkpoint names must resolve inside its folder (no `../`, absolute paths or symlinks leading out), and every error
names the file and the tensor or index entry.

Dtypes: float tensors load in their stored dtype (the release: bf16, fp32 for the `FP32_PARAM_SUFFIXES` tensors; our
training: fp32 everywhere). MXFP4 `weight_packed`/`weight_scale` must be uint8, and an integer or bool tensor where a
float belongs is refused. With `dtype=None`, stored dtypes the forward cannot run together are converted, with one
warning giving the counts: fp16/fp64 `FP32_PARAM_SUFFIXES` tensors to fp32, every other tensor to bf16 if any of them
is stored in bf16, else to fp32 (exact for fp16); so fp16, fp64 or a stray fp32 matrix among bf16 ones load runnable.
MXFP4 experts decode exactly into that dtype, silently. With `dtype` given, `to_dtype` converts everything anyway.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from openk3.config import K3Config
from openk3.ops.moe.mxfp4 import check_scales, mxfp4_pack, mxfp4_unpack
from openk3.utils import file_inside, open_permissions, read_json

log = logging.getLogger("openk3")

PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])$")
_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_MAX_NAMES = 12


def _names(keys) -> str:
    keys = sorted(keys)
    more = f" ... (+{len(keys) - _MAX_NAMES} more)" if len(keys) > _MAX_NAMES else ""
    return ", ".join(keys[:_MAX_NAMES]) + more


def _open_safetensors(file: str):
    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as err:  # neither names the file
        raise ValueError(f"{file}: not a readable safetensors file ({err})") from err


def weight_files(path: str) -> dict[str, str]:
    """Map every stored tensor name to the file holding it, inside `path`."""
    index = file_inside(path, INDEX_FILE)
    if os.path.exists(index):
        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            got = "nothing" if weight_map is None else f"a {type(weight_map).__name__}"
            raise ValueError(f"{index}: 'weight_map' must be an object of tensor name -> shard file, got {got}")
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise ValueError(f"{index}: weight_map[{key!r}] must be a file name, got {name!r}")
        shards = {name: file_inside(path, name, f"{index}: weight_map file") for name in set(weight_map.values())}
        missing = {name for name, file in shards.items() if not os.path.exists(file)}
        if missing:
            raise FileNotFoundError(f"{index} names shard files that do not exist: {_names(missing)}")
        return {k: shards[v] for k, v in weight_map.items()}
    single = file_inside(path, SINGLE_FILE)
    if os.path.exists(single):
        with _open_safetensors(single) as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    pickles = [n for n in os.listdir(path) if n.endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise ValueError(
            f"{path} holds only pickle weight files ({_names(pickles)}); openk3 never unpickles weights because "
            f"that can execute arbitrary code. Convert them to safetensors in a trusted environment first."
        )
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


class _Reader:
    """Opens each safetensors file once and reads tensors by name; errors name the file and the tensor."""

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._handles: dict[str, object] = {}

    def _handle(self, key: str):
        file = self.files[key]
        if file not in self._handles:
            self._handles[file] = _open_safetensors(file)
        return self._handles[file]

    def get(self, key: str, mxfp4: bool = False) -> torch.Tensor:
        """Tensor `key`: a float tensor, or uint8 where `mxfp4` (packed codes and scales)."""
        try:
            tensor = self._handle(key).get_tensor(key)
        except SafetensorError as err:
            raise ValueError(f"{self.files[key]}: cannot read tensor {key} ({err})") from err
        if (tensor.dtype != torch.uint8) if mxfp4 else not tensor.is_floating_point():
            raise ValueError(f"{self.files[key]}: tensor {key} is stored as {tensor.dtype}, expected "
                             f"{'uint8 (MXFP4)' if mxfp4 else 'a float dtype'}")  # fmt: skip
        return tensor

    def shape(self, key: str) -> tuple[int, ...]:
        try:
            return tuple(self._handle(key).get_slice(key).get_shape())
        except SafetensorError as err:
            raise ValueError(f"{self.files[key]}: cannot read tensor {key} ({err})") from err


def _expert_keys(base: str, matrix: str, e: int) -> str:
    return f"{PREFIX}{base}.{e}.{matrix}"


def load_pretrained(cls, path, dtype: torch.dtype | None = None, device="cpu"):
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    config = K3Config.from_pretrained(path)
    files = weight_files(path)
    reader = _Reader(files)
    with torch.device("meta"):
        model = cls(config)
    # The multimodal model holds the text model as `language_model`, whose names are ours after that prefix.
    text_model = getattr(model, "language_model", model)
    ours = "language_model." if text_model is not model else ""

    used: set[str] = set()
    skipped = [k for k in files if k.startswith(VISION_PREFIXES)]
    if skipped and text_model is model:
        log.warning("skipping %d vision tensors (vision_tower.*, mm_projector.*): K3ForCausalLM is the text model; "
                    "load with K3ForConditionalGeneration to use them", len(skipped))  # fmt: skip
        used.update(skipped)
    decoded: set[str] = set()  # parameters decoded from MXFP4, exact in any float dtype
    missing, bad_shape, state = [], [], {}
    for name, param in text_model.named_parameters():
        m = _EXPERTS.match(name)
        if m:
            tensor, hints = _load_experts(reader, m.group(1), m.group(2), tuple(param.shape), used, missing, bad_shape)
            if tensor is not None:
                state[ours + name] = tensor
                if hints is not None:
                    decoded.add(ours + name)
                    experts = text_model.get_submodule(m.group(1))
                    experts.__dict__.setdefault("mxfp4_scale_hints", {})[m.group(2)] = hints
            continue
        key = PREFIX + name
        if key not in files:
            missing.append(key)
            continue
        used.add(key)
        tensor = reader.get(key)
        if name.endswith("A_log"):
            tensor = _unpad_a_log(f"{files[key]}: {key}", tensor, param.shape[0])
        if tuple(tensor.shape) != tuple(param.shape):
            bad_shape.append(f"{key} {tuple(tensor.shape)} (expected {tuple(param.shape)})")
            continue
        state[ours + name] = tensor
    for name, param in model.named_parameters():
        if not name.startswith(VISION_PREFIXES):
            continue
        if name not in files:
            missing.append(name)
            continue
        used.add(name)
        tensor = reader.get(name)
        if tuple(tensor.shape) != tuple(param.shape):
            bad_shape.append(f"{name} {tuple(tensor.shape)} (expected {tuple(param.shape)})")
            continue
        state[name] = tensor
    unexpected = set(files) - used
    problems = []
    if missing:
        problems.append(f"missing tensors: {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if bad_shape:
        problems.append(f"wrongly shaped tensors: {_names(bad_shape)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config.json; " + "; ".join(problems))
    if dtype is None:
        _unify_dtypes(path, state, decoded)
    model.load_state_dict(state, assign=True, strict=True)
    for name, p in model.named_parameters():  # assign=True keeps requires_grad of the loaded tensor
        p.requires_grad_(not name.endswith("e_score_correction_bias"))
    if dtype is not None:
        model.to_dtype(dtype)
    return model.to(device)


def _unify_dtypes(path: str, state: dict[str, torch.Tensor], decoded: set[str]) -> None:
    """Convert, in place, the tensors whose stored dtype the forward cannot run next to the others (module
    docstring), and warn once with the counts; `decoded` (MXFP4) tensors follow the others silently."""
    from openk3.model.model import keeps_fp32  # model.py imports this module

    stored = {t.dtype for name, t in state.items() if not keeps_fp32(name) and name not in decoded}
    compute = torch.bfloat16 if torch.bfloat16 in stored else torch.float32
    converted: Counter[str] = Counter()
    for name, tensor in state.items():
        if keeps_fp32(name):
            want = tensor.dtype if tensor.dtype in (torch.bfloat16, torch.float32) else torch.float32
        else:
            want = compute
        if tensor.dtype != want:
            if name not in decoded:
                converted[f"{tensor.dtype} -> {want}"] += 1
            state[name] = tensor.to(want)
    if converted:
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(converted.items()))
        log.warning("checkpoint %s: converted %d tensors to dtypes the model can run (%s); pass dtype= to choose one",
                    path, sum(converted.values()), counts)  # fmt: skip


def _unpad_a_log(key: str, tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    if tensor.dim() == 1 and tensor.shape[0] > num_heads:
        if bool((tensor[num_heads:] != 0).any()):
            raise ValueError(f"{key}: padding entries {num_heads}..{tensor.shape[0] - 1} of A_log must be exactly zero")
        return tensor[:num_heads].clone()
    return tensor


def _load_experts(reader, base, matrix, shape, used, missing, bad_shape):
    """Stack one layer's `experts.{e}.{matrix}` into [E, out, in]; MXFP4 is decoded exactly. Returns
    (tensor or None, scale hints [E, out, in/32] or None)."""
    E, out_dim, in_dim = shape
    pieces, scales = [], []
    for e in range(E):
        key = _expert_keys(base, matrix, e)
        if key + ".weight" in reader.files:
            used.add(key + ".weight")
            t = reader.get(key + ".weight")
            if tuple(t.shape) != (out_dim, in_dim):
                bad_shape.append(f"{key}.weight {tuple(t.shape)} (expected {(out_dim, in_dim)})")
                continue
            pieces.append(t)
        elif key + ".weight_packed" in reader.files and key + ".weight_scale" in reader.files:
            used.update((key + ".weight_packed", key + ".weight_scale"))
            packed = reader.get(key + ".weight_packed", mxfp4=True)
            scale = reader.get(key + ".weight_scale", mxfp4=True)
            if tuple(packed.shape) != (out_dim, in_dim // 2) or tuple(scale.shape) != (out_dim, in_dim // 32):
                bad_shape.append(
                    f"{key}.weight_packed/.weight_scale {tuple(packed.shape)}/{tuple(scale.shape)} "
                    f"(expected {(out_dim, in_dim // 2)}/{(out_dim, in_dim // 32)})"
                )
                continue
            check_scales(scale, torch.bfloat16, f"{reader.files[key + '.weight_scale']}: {key}.weight_scale")
            pieces.append(mxfp4_unpack(packed, scale, torch.bfloat16))
            scales.append(scale)
        else:
            missing.append(key + ".weight")
    if len(pieces) != E:
        return None, None
    hints = torch.stack(scales) if len(scales) == E else None
    return torch.stack(pieces), hints


def _checkpoint_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (official name, tensor) for the text model, then the vision tensors of a multimodal model, in the
    dtypes they have in `model`."""
    text = model.config.text_config
    quant = text.quantization_config
    text_model = getattr(model, "language_model", model)
    for name, param in model.named_parameters():
        if name.startswith(VISION_PREFIXES):
            yield name, param.detach()
    for name, param in text_model.named_parameters():
        t = param.detach()
        m = _EXPERTS.match(name)
        if m:
            hints = getattr(text_model.get_submodule(m.group(1)), "mxfp4_scale_hints", {}).get(m.group(2))
            for e in range(t.shape[0]):
                key = _expert_keys(m.group(1), m.group(2), e)
                if quant is not None:
                    packed, scale = mxfp4_pack(t[e], hints[e] if hints is not None else None)
                    yield key + ".weight_packed", packed
                    yield key + ".weight_scale", scale
                else:
                    yield key + ".weight", t[e]
            continue
        if name.endswith("A_log"):
            width = max(text.linear_attn_config.head_dim, t.shape[0])
            t = torch.cat([t, t.new_zeros(width - t.shape[0])])
        yield PREFIX + name, t


def save_pretrained(model, path, max_shard_size: int | None = None) -> None:
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.contiguous().cpu() for k, v in _checkpoint_tensors(model)}
    sizes = {k: v.numel() * v.element_size() for k, v in tensors.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    running = 0
    for key in sorted(tensors):
        if max_shard_size is not None and shards[-1] and running + sizes[key] > max_shard_size:
            shards.append({})
            running = 0
        shards[-1][key] = tensors[key]
        running += sizes[key]
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:06d}-of-{n:06d}.safetensors" for i in range(n)]
    # Write every file under a temporary name first, then rename: a crash leaves the previous checkpoint intact.
    written = []
    for name, shard in zip(names, shards):
        tmp = os.path.join(path, f".{name}.tmp")
        save_file(shard, tmp, metadata={"format": "pt"})
        open_permissions(tmp)
        written.append((tmp, os.path.join(path, name)))
    index_tmp = None
    if n > 1:
        weight_map = {k: names[i] for i, shard in enumerate(shards) for k in shard}
        index_tmp = os.path.join(path, f".{INDEX_FILE}.tmp")
        with open(index_tmp, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))},
                      f, indent=2)  # fmt: skip
            f.write("\n")
    for tmp, final in written:
        os.replace(tmp, final)
    if index_tmp is not None:
        os.replace(index_tmp, os.path.join(path, INDEX_FILE))
    # Remove weight files of an earlier save with a different layout so no stale tensors are picked up.
    for stale in os.listdir(path):
        if stale in names:
            continue
        if stale == SINGLE_FILE or _SHARD.match(stale) or (stale == INDEX_FILE and n == 1):
            os.remove(os.path.join(path, stale))
    model.config.save_pretrained(path)
