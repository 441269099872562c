"""Loading untrusted checkpoint folders (issue 19 items 6-7): every file stays inside the folder, every error is one
ValueError naming the file and the tensor or field, odd dtypes convert or refuse before the forward, absurd config
sizes are refused before anything is allocated, and broken tokenizer files are named."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import struct
from types import SimpleNamespace

import pytest
import torch
from config_edit import edited_preset
from fixture_paths import LOGITS, MXFP4, PLAIN
from safetensors.torch import load_file, save_file

from openk3 import K3Config, K3ForCausalLM
from openk3.data.tokenizer import load_tokenizer, train_bpe
from openk3.utils import rel_rms

INDEX = "model.safetensors.index.json"


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite_index(folder, edit):
    with open(folder / INDEX) as f:
        data = json.load(f)
    edit(data)
    with open(folder / INDEX, "w") as f:
        json.dump(data, f)


def _shard_of(folder, key_part):
    with open(folder / INDEX) as f:
        weight_map = json.load(f)["weight_map"]
    return next(v for k, v in weight_map.items() if key_part in k)


def _point(folder, shard, entry):
    """Make every index entry naming `shard` name `entry` instead."""

    def edit(data):
        data["weight_map"] = {k: entry if v == shard else v for k, v in data["weight_map"].items()}

    _rewrite_index(folder, edit)


def _raises_named(*parts):
    return pytest.raises(ValueError, match=".*".join(re.escape(str(p)) for p in parts))


# Confinement: a checkpoint names only files inside its folder.


@pytest.mark.parametrize("how", ["relative", "absolute", "symlinked shard", "symlinked folder"])
def test_index_entry_leaving_the_folder_is_refused(tmp_path, how):
    dst = _copy(MXFP4, tmp_path)
    shard = _shard_of(dst, "lm_head")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(dst / shard, outside / shard)  # a valid shard: the old loader read it and succeeded
    entry = {"relative": f"../elsewhere/{shard}", "absolute": str(outside / shard), "symlinked shard": shard,
             "symlinked folder": f"sub/{shard}"}[how]  # fmt: skip
    if how == "symlinked shard":
        os.remove(dst / shard)
        os.symlink(outside / shard, dst / shard)
    elif how == "symlinked folder":
        os.symlink(outside, dst / "sub")
    _point(dst, shard, entry)
    with _raises_named(dst / INDEX, f"weight_map file {entry!r}", "not inside the folder"):
        K3ForCausalLM.from_pretrained(dst)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_single_file_or_config_symlink_leaving_the_folder_is_refused(tmp_path, name):
    dst = _copy(PLAIN, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(dst / name, tmp_path / "elsewhere" / name)
    os.symlink(tmp_path / "elsewhere" / name, dst / name)
    with _raises_named(f"checkpoint file {name!r}", tmp_path / "elsewhere" / name, "not inside the folder"):
        K3ForCausalLM.from_pretrained(dst)


def test_symlinks_that_stay_inside_still_load(tmp_path):
    dst = _copy(MXFP4, tmp_path)
    shard = _shard_of(dst, "lm_head")
    (dst / "blobs").mkdir()
    shutil.move(dst / shard, dst / "blobs" / shard)
    os.symlink(os.path.join("blobs", shard), dst / shard)
    loaded, direct = K3ForCausalLM.from_pretrained(dst), K3ForCausalLM.from_pretrained(MXFP4)
    for (name, a), (_, b) in zip(loaded.named_parameters(), direct.named_parameters()):
        assert torch.equal(a, b), name


def test_a_hugging_face_cache_snapshot_loads_but_not_its_neighbours_blobs(tmp_path):
    """A snapshot folder holds symlinks into its own repository's blobs/ (hub's layout): allowed. A symlink into
    another repository's blobs is still refused."""
    repo = tmp_path / "hub" / "models--moonshot--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sorted(os.listdir(PLAIN)):
        shutil.copy(os.path.join(PLAIN, f), blobs / f"blob-{f}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{f}"), snap / f)
    loaded, direct = K3ForCausalLM.from_pretrained(snap), K3ForCausalLM.from_pretrained(PLAIN)
    for (name, a), (_, b) in zip(loaded.named_parameters(), direct.named_parameters()):
        assert torch.equal(a, b), name
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    shutil.move(blobs / "blob-model.safetensors", other / "stolen")
    os.remove(snap / "model.safetensors")
    os.symlink(other / "stolen", snap / "model.safetensors")
    with pytest.raises(ValueError, match="not inside the folder"):
        K3ForCausalLM.from_pretrained(snap)


# Index and config.json errors name the file and the entry or field.


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(weight_map=["a.safetensors"]), "'weight_map' must be an object .* got a list"),
        (lambda d: d.pop("weight_map"), "'weight_map' must be an object .* got nothing"),
        (lambda d: d["weight_map"].update({"language_model.lm_head.weight": 7}),
         r"weight_map\['language_model.lm_head.weight'\] must be a file name, got 7"),
        (lambda d: d["weight_map"].update({"language_model.lm_head.weight": "."}), "weight_map file '.'"),
        (lambda d: d["weight_map"].update({"language_model.lm_head.weight": ""}), "weight_map file ''"),
    ],
    ids=["list", "missing", "non-string", "dot", "empty"],
)  # fmt: skip
def test_malformed_weight_map_is_named(tmp_path, edit, match):
    dst = _copy(MXFP4, tmp_path)
    _rewrite_index(dst, edit)
    with pytest.raises(ValueError, match=re.escape(str(dst / INDEX)) + ": " + match):
        K3ForCausalLM.from_pretrained(dst)


@pytest.mark.parametrize(
    "name, text, match",
    [
        (INDEX, '{\n  "weight_map": {,}\n}', "invalid JSON at line 2 column 18"),
        ("config.json", '{"text_config": {\n  "vocab_size": 512,\n}}', "invalid JSON at line 3 column 1"),
        ("config.json", "null", "config must be a JSON object, got None"),
        ("config.json", "[1, 2]", r"config must be a JSON object, got \[1, 2\]"),
    ],
    ids=["index-syntax", "config-syntax", "config-null", "config-list"],
)
def test_unreadable_json_is_named(tmp_path, name, text, match):
    dst = _copy(MXFP4, tmp_path)
    (dst / name).write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(dst / name)) + ": " + match):
        K3ForCausalLM.from_pretrained(dst)


# safetensors errors name the file, and the tensor when reading one.


def _overflowing_shape(data: bytes) -> bytes:
    header = json.dumps({"language_model.lm_head.weight": {"dtype": "F32", "shape": [2**40, 2**40],
                                                           "data_offsets": [0, 4]}}).encode()  # fmt: skip
    return struct.pack("<Q", len(header)) + header + b"\0" * 4


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: data[:5],  # shorter than the header length
        lambda data: struct.pack("<Q", 2**40) + data[8:],  # oversized header
        lambda data: struct.pack("<Q", 16) + b"this is no json!" + data[24:],  # garbage header
        _overflowing_shape,
    ],
    ids=["truncated", "tiny", "oversized-header", "garbage-header", "overflowing-shape"],
)
def test_corrupt_safetensors_names_the_file(tmp_path, corrupt):
    dst = _copy(PLAIN, tmp_path)
    file = dst / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with _raises_named(f"{file}: not a readable safetensors file"):
        K3ForCausalLM.from_pretrained(dst)


def test_corrupt_shard_and_misplaced_tensor_name_the_file(tmp_path):
    dst = _copy(MXFP4, tmp_path)
    shard = _shard_of(dst, "lm_head")
    data = (dst / shard).read_bytes()
    (dst / shard).write_bytes(data[: len(data) - 100])
    with _raises_named(f"{dst / shard}: not a readable safetensors file"):
        K3ForCausalLM.from_pretrained(dst)
    (dst / shard).write_bytes(data)
    other = next(s for s in os.listdir(dst) if s.endswith(".safetensors") and s != shard)
    _rewrite_index(dst, lambda d: d["weight_map"].update({"language_model.lm_head.weight": other}))
    with _raises_named(f"{dst / other}: cannot read tensor language_model.lm_head.weight"):
        K3ForCausalLM.from_pretrained(dst)


# Dtypes outside the release's set convert (fp16, fp64) or are refused (integers, bools) before the forward.

MAIN = "language_model.model.layers.3.self_attn.q_b_proj.weight"  # bf16 in the release
EXTRA = "language_model.model.layers.0.self_attn.dt_bias"  # fp32 in the release


def _with_tensors(tmp_path, edit, src=PLAIN):
    dst = _copy(src, tmp_path)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("stored", [torch.float16, torch.float64, torch.float32])
def test_fp16_fp64_and_stray_fp32_tensors_convert_with_one_warning(tmp_path, caplog, stored):
    dst = _with_tensors(tmp_path, lambda t: t.update({k: t[k].to(stored) for k in (MAIN, EXTRA)}))
    with caplog.at_level(logging.WARNING, logger="openk3"):
        model = K3ForCausalLM.from_pretrained(dst)
    notices = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    assert len(notices) == 1, notices
    assert f"1 {stored} -> torch.bfloat16" in notices[0]  # MAIN
    if stored == torch.float32:  # the fp32 EXTRA is what the release stores
        assert "converted 1 tensors" in notices[0]
    else:
        assert "converted 2 tensors" in notices[0] and f"1 {stored} -> torch.float32" in notices[0]
    plain = K3ForCausalLM.from_pretrained(PLAIN)
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in plain.named_parameters()}
    # Value for value and dtype for dtype the release fixture rounded through `stored`, so the forward runs as it
    # does there (the old loader kept the stray dtype, and F.linear refused to mix it with bf16).
    for (name, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        expected = b.to(stored).to(b.dtype) if "language_model." + name in (MAIN, EXTRA) else b
        assert a.dtype == b.dtype and torch.equal(a, expected), name


def test_release_and_fp32_checkpoints_load_without_conversion(tmp_path, caplog):
    fp32 = K3ForCausalLM.from_pretrained(PLAIN, dtype=torch.float32)
    fp32.config = K3Config.from_pretrained(MXFP4)  # our training's fp32 tensors, experts saved as MXFP4
    fp32.save_pretrained(tmp_path / "fp32")
    with caplog.at_level(logging.WARNING, logger="openk3"):
        for folder in (PLAIN, MXFP4, tmp_path / "fp32"):
            model = K3ForCausalLM.from_pretrained(folder)
    assert not [r for r in caplog.records if "converted" in r.getMessage()]
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the MXFP4 experts decode into fp32 too
    ref = load_file(LOGITS)
    with torch.no_grad():
        assert rel_rms(model(ref["input_ids"]).logits, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("stored", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_tensor_where_a_float_belongs_is_named(tmp_path, stored):
    dst = _with_tensors(tmp_path, lambda t: t.update({MAIN: t[MAIN].to(stored)}))
    with _raises_named(f"{dst / 'model.safetensors'}: tensor {MAIN} is stored as {stored}, expected a float dtype"):
        K3ForCausalLM.from_pretrained(dst)


def test_float_mxfp4_codes_are_named(tmp_path):
    dst = _copy(MXFP4, tmp_path)
    key = "language_model.model.layers.2.block_sparse_moe.experts.3.w1.weight_packed"
    shard = _shard_of(dst, key)
    tensors = load_file(dst / shard)
    tensors[key] = tensors[key].float()
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    with _raises_named(f"{dst / shard}: tensor {key} is stored as torch.float32, expected uint8"):
        K3ForCausalLM.from_pretrained(dst)


# Config validation: types and bounds, checked before anything is built from the sizes.


def _tiny_dict(**changes):
    return edited_preset("tiny", **changes)


@contextlib.contextmanager
def _memory_cap(extra: int = 2 << 30):
    """A runaway allocation (the old validate built set(range(10**9))) becomes a quick MemoryError, not an OOM."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * resource.getpagesize()
    cap = used + extra if hard == resource.RLIM_INFINITY else min(used + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"text_config__num_hidden_layers": 10**9}, r"num_hidden_layers must be an integer in \[1, 10000\]"),
        ({"text_config__num_hidden_layers": 1e9}, r"text_config\.num_hidden_layers must be an integer"),
        ({"text_config__vocab_size": 2**40}, r"text_config\.vocab_size must be an integer in"),
        ({"text_config__num_experts": 10**7}, r"text_config\.num_experts must be an integer in"),
        ({"text_config__linear_attn_config__num_heads": 10**6}, r"linear_attn_config\.num_heads must be an integer in"),
        ({"text_config__first_k_dense_replace": 1.0}, r"text_config\.first_k_dense_replace must be an integer"),
        ({"text_config__num_nextn_predict_layers": False}, r"text_config\.num_nextn_predict_layers must be an integer"),
        ({"text_config__pad_token_id": 1023.0}, r"text_config\.pad_token_id must be an integer"),
        ({"text_config__linear_attn_config__kda_layers": [1.0, 2.0, 3.0, 5.0, 6.0, 7.0]},
         r"text_config\.linear_attn_config\.kda_layers must be a list of integers"),
        ({"text_config__linear_attn_config__full_attn_layers": [4, "8", 9]},
         r"text_config\.linear_attn_config\.full_attn_layers must be a list of integers"),
    ],
    ids=["layers-1e9-int", "layers-1e9-float", "vocab", "experts", "kda-heads", "float-dense", "bool-mtp", "float-pad",
         "float-layer-list", "str-in-layer-list"],
)  # fmt: skip
def test_absurd_or_non_integer_sizes_are_refused_before_allocating(changes, match):
    data = _tiny_dict(**changes)
    with _memory_cap(), pytest.raises(ValueError, match=match):
        K3Config.from_dict(data)


def test_size_bounds_are_generous_for_the_release():
    from openk3.config import _KDA_SIZES, _TEXT_SIZES

    text = K3Config.preset("k3").text_config
    for name, (lo, hi) in _TEXT_SIZES.items():
        assert lo <= getattr(text, name) and 4 * getattr(text, name) <= hi, name
    for name, (lo, hi) in _KDA_SIZES.items():
        assert lo <= getattr(text.linear_attn_config, name) and 4 * getattr(text.linear_attn_config, name) <= hi, name


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"text_config__linear_attn_config": "x"}, r"^text_config\.linear_attn_config must be a JSON object, got 'x'$"),
        ({"text_config__linear_attn_config": [1]}, r"^text_config\.linear_attn_config must be a JSON object"),
        ({"text_config": "x"}, r"^text_config must be a JSON object"),
        ({"text_config": None}, r"^text_config must be a JSON object, got None$"),
        ({"text_config__quantization_config": 3}, r"^text_config\.quantization_config must be a JSON object"),
        ({"text_config__quantization_config": {"config_groups": {"group_0": 3}}}, r"config_groups\.group_0\.weights"),
        ({"text_config__linear_attn_config__num_heads": "x"}, r"linear_attn_config\.num_heads must be an integer"),
        ({"text_config__linear_attn_config__gate_lower_bound": "x"}, r"gate_lower_bound must be a finite number"),
        ({"text_config__rms_norm_eps": float("nan")}, r"text_config\.rms_norm_eps must be a finite number"),
        ({"text_config__mla_use_nope": "yes"}, r"text_config\.mla_use_nope must be true or false"),
        ({"text_config__architectures": "x"}, r"text_config\.architectures must be a list of strings"),
        ({"vision_config": 3}, r"^vision_config must be a JSON object"),
    ],
    ids=["la-str", "la-list", "text-str", "text-null", "quant-int", "quant-group-int", "kda-heads-str", "bound-str",
         "eps-nan", "nope-str", "architectures-str", "vision-int"],
)  # fmt: skip
def test_fields_of_the_wrong_type_are_named(changes, match):
    with pytest.raises(ValueError, match=match):
        K3Config.from_dict(_tiny_dict(**changes))


def test_config_errors_from_a_folder_name_the_file(tmp_path):
    dst = _copy(PLAIN, tmp_path)
    data = json.loads((dst / "config.json").read_text())
    data["text_config"]["linear_attn_config"] = "x"
    (dst / "config.json").write_text(json.dumps(data))
    with _raises_named(f"{dst / 'config.json'}: text_config.linear_attn_config must be a JSON object"):
        K3Config.from_pretrained(dst)


# Tokenizer files: garbage or truncated files are a ValueError naming the file; symlinks may not leave the folder.

TINY_TEXT = K3Config.preset("tiny").text_config


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    special = {"bos": TINY_TEXT.bos_token_id, "eos": TINY_TEXT.eos_token_id, "pad": TINY_TEXT.pad_token_id}
    train_bpe(["the quick brown fox jumps over the lazy dog"] * 20, TINY_TEXT.vocab_size, special).save(folder)
    return (folder / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("corrupt", [lambda d: d[: len(d) // 2], lambda d: b"\x00\xff garbage", lambda d: b'{"a": 1}'],
                         ids=["truncated", "garbage", "wrong-json"])  # fmt: skip
def test_broken_tokenizer_json_is_named(tmp_path, bpe_json, corrupt):
    (tmp_path / "tokenizer.json").write_bytes(bpe_json)
    assert load_tokenizer(tmp_path, TINY_TEXT).vocab_size == TINY_TEXT.vocab_size
    (tmp_path / "tokenizer.json").write_bytes(corrupt(bpe_json))
    with _raises_named(f"{tmp_path / 'tokenizer.json'}: not a readable tokenizers file"):
        load_tokenizer(tmp_path, TINY_TEXT)


def _tiktoken_dir(path, config=None):
    lines = "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    (path / "tiktoken.model").write_text(lines)
    (path / "tokenizer_config.json").write_text(json.dumps(config or {"pat_str": r"\S+|\s+"}))
    return SimpleNamespace(vocab_size=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize(
    "name, corrupt, match",
    [
        ("tiktoken.model", lambda d: d[: len(d) // 2 + 3], r"tiktoken\.model:\d+: expected 'base64-token rank'"),
        ("tiktoken.model", lambda d: bytes(range(256)) * 4, r"tiktoken\.model:\d+: expected 'base64-token rank'"),
        ("tiktoken.model", lambda d: b"", r"tiktoken\.model: no 'base64-token rank' lines"),
        ("tokenizer_config.json", lambda d: b'{"pat_str": "((", }', r"tokenizer_config\.json: invalid JSON at line 1"),
        ("tokenizer_config.json", lambda d: b'{"pat_str": "(("}', r"cannot build an encoding \(pattern '\(\('"),
        ("tokenizer_config.json", lambda d: b"[]", r"tokenizer_config\.json: must be a JSON object"),
        ("tokenizer_config.json", lambda d: b'{"pat_str": "x", "added_tokens_decoder": {"a": 1}}',
         r"tokenizer_config\.json: added_tokens_decoder\['a'\]"),
    ],
    ids=["model-truncated", "model-garbage", "model-empty", "config-syntax", "config-bad-pattern", "config-list",
         "config-bad-decoder"],
)  # fmt: skip
def test_broken_tiktoken_files_are_named(tmp_path, name, corrupt, match):
    text = _tiktoken_dir(tmp_path)
    assert load_tokenizer(tmp_path, text).vocab_size == 512
    (tmp_path / name).write_bytes(corrupt((tmp_path / name).read_bytes()))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*" + match):
        load_tokenizer(tmp_path, text)


@pytest.mark.parametrize("name", ["tiktoken.model", "tokenizer_config.json"])
def test_tokenizer_symlink_leaving_the_folder_is_refused(tmp_path, name):
    folder, outside = tmp_path / "tok", tmp_path / "elsewhere"
    folder.mkdir()
    outside.mkdir()
    text = _tiktoken_dir(folder)
    shutil.move(folder / name, outside / name)
    os.symlink(outside / name, folder / name)
    with _raises_named(f"tokenizer file {name!r}", outside / name, "not inside the folder"):
        load_tokenizer(folder, text)


def test_saved_weights_honour_the_umask(tmp_path):
    """save_pretrained (k3 export, k3 init) writes files as `open` would, not safetensors' 0600."""
    model = K3ForCausalLM(K3Config.preset("tiny"))
    model.init_random_weights(0)
    old = os.umask(0o022)
    try:
        model.save_pretrained(tmp_path / "one")
        model.save_pretrained(tmp_path / "sharded", max_shard_size=1 << 20)
    finally:
        os.umask(old)
    for folder in ("one", "sharded"):
        modes = {n: os.stat(tmp_path / folder / n).st_mode & 0o777 for n in os.listdir(tmp_path / folder)}
        assert len(modes) >= 2 and set(modes.values()) == {0o644}, modes
