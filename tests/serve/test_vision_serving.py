"""Images through serving: the engine ≡ a full multimodal forward recomputed every step, image
rows through chunked prefill, prefix-cache hits keyed by the image's pixels, and the server's image content parts
through the `openai` client (data URLs only, every bad image a 400 in OpenAI's error shape).

The model is the official tiny fixture with its vision tower (vocab 512, placeholder id 277); greedy tokens are
compared only up to the first near-tie of the reference.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import openai
import pytest
import torch
from fixture_paths import FIXTURES, PLAIN
from PIL import Image
from serve_helpers import (
    MARGIN,
    LogitTap,
    bpe_tokenizer,
    make_engine,
    run_outputs,
    run_to_end,
    serve_on_loopback,
)  # fmt: skip

from openk3 import K3ForCausalLM, K3ForConditionalGeneration
from openk3.data.chat import PlainChatTemplate, XTMLChatTemplate
from openk3.data.vision import image_prompt, num_image_tokens, preprocess
from openk3.serve.async_engine import AsyncLLM
from openk3.serve.config import ServeConfig
from openk3.serve.engine import LLM, LLMEngine
from openk3.serve.protocol import chat_request
from openk3.serve.request import SamplingParams
from openk3.serve.scheduler import StepPlan
from openk3.serve.server import build_app

CKPT = PLAIN
IMAGES = os.path.join(FIXTURES, "k3-official-tiny-vision")
PH = 277  # media_placeholder_token_id of the tiny configs
UNITS = {"hash_unit": 4, "block_size": 16, "max_model_len": 128}


@pytest.fixture(scope="module")
def vlm() -> K3ForConditionalGeneration:
    return K3ForConditionalGeneration.from_pretrained(CKPT, dtype=torch.float32).eval()


def _image(name: str) -> Image.Image:
    return Image.open(f"{IMAGES}/{name}").convert("RGB")


def _noise(seed: int, size=(56, 56)) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())


@torch.no_grad()
def _reference(model, prompt: list[int], images: list[Image.Image], n: int) -> tuple[list[int], int]:
    """Greedy tokens from the full multimodal forward recomputed at every step (one placeholder per image, the
    model expands it), and how many of them precede the first near-tie."""
    pixel_values, grid_thws = preprocess(images)
    out, margins = [], []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out]), pixel_values, grid_thws).logits[0, -1]
        top2 = logits.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        out.append(int(logits.argmax()))
    clear = next((i for i, m in enumerate(margins) if m <= MARGIN), n)
    return out, clear


def _generate(engine, prompt, n: int = 6) -> tuple[list[int], object]:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    final = run_outputs(engine)[rid]
    return final.outputs[0].token_ids, final


@pytest.mark.parametrize("case", ["one", "two", "chunked", "expanded"])
def test_engine_matches_full_multimodal_forward(vlm, case):
    images = [_image("image0_100x70.png")] if case in ("one", "chunked", "expanded") else [
        _image("image0_100x70.png"), _image("image2_45x90.png")]  # fmt: skip
    prompt = [256, 5, 9, PH, 17, 40] if len(images) == 1 else [256, 5, PH, 9, 30, PH, 17, 40]
    ref, clear = _reference(vlm, prompt, images, 6)
    assert clear >= 3, "the fixture prompt must have clear margins"
    options = dict(UNITS, max_num_batched_tokens=4) if case == "chunked" else dict(UNITS)
    engine = make_engine(vlm, **options)
    ids = prompt
    if case == "expanded":  # N placeholders already in place (vLLM's convention) are kept as they are
        N = num_image_tokens(preprocess(images)[1][0])
        ids = prompt[:3] + [PH] * N + prompt[4:]
    if case == "chunked":  # the 12 image rows (positions 3..14) are split over four 4-token chunks
        calls = []
        run = engine.runner.run
        engine.runner.run = lambda reqs, i, r, verify=False: (
            calls.append([len(x) for x in i]) or run(reqs, i, r, verify)
        )
    got, out = _generate(engine, {"prompt_token_ids": ids, "multi_modal_data": {"image": images}})
    assert got[:clear] == ref[:clear]
    expected_len = len(prompt) - len(images) + sum(num_image_tokens(g) for g in preprocess(images)[1])
    assert len(out.prompt_token_ids) == expected_len
    if case == "chunked":
        assert max(sum(c) for c in calls) <= 4 and sum(1 for c in calls if c == [4]) >= 4


def test_text_prompt_marks_images_with_media_pad(vlm):
    """A text prompt writes `<|media_pad|>` once per image; it becomes the placeholder id only in a multimodal
    prompt (elsewhere user text never yields special ids). A count mismatch is a ValueError naming the counts."""
    tok = bpe_tokenizer(512, 256, 258, 511)
    llm = LLM(vlm, tokenizer=tok, **UNITS)
    images = [_image("image1_56x56.png"), _image("image0_100x70.png")]
    text = "look <|media_pad|> and <|media_pad|> now"
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, SamplingParams(max_tokens=3))[0]
    ids = out.prompt_token_ids
    assert ids.count(PH) == 4 + 12 and ids[0] == 256
    plain = llm.generate(text, SamplingParams(max_tokens=1))[0].prompt_token_ids
    assert PH not in plain
    with pytest.raises(ValueError, match="1 placeholder tokens .* for 2 images"):
        llm.generate({"prompt": "one <|media_pad|>", "multi_modal_data": {"image": images}})
    text_only = LLM(K3ForCausalLM.from_pretrained(CKPT, dtype=torch.float32), tokenizer=tok, **UNITS)
    with pytest.raises(ValueError, match="text-only"):
        text_only.generate({"prompt": text, "multi_modal_data": {"image": images}})
    with pytest.raises(ValueError, match="content.0.image_url: a data URL must carry base64"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_llm_loads_vision_checkpoint():
    llm = LLM(CKPT, tokenizer=bpe_tokenizer(512, 256, 258, 511), **UNITS)
    assert llm.engine.vision_model is not None
    out = llm.generate({"prompt_token_ids": [256, 7, PH, 8], "multi_modal_data": {"image": _noise(0)}},
                       SamplingParams(max_tokens=2))[0]  # fmt: skip
    assert len(out.outputs[0].token_ids) == 2 and len(out.prompt_token_ids) == 3 + 4


def test_image_prefix_hit_equals_recompute_and_other_image_misses(vlm):
    """Turn 2 repeats turn 1 (same image) and adds text: it hits the cache through the image's units and equals a
    cache-less run; the same ids with a different image (same size) miss from the image's first unit on."""
    a, b = _noise(1), _noise(2)  # 56x56: 4 rows each, behind identical ids
    turn1 = [256, 11, 12, 13, 14, 15, PH, 20, 21, 22, 23, 24, 25, 26]
    first, _ = _generate(warm := make_engine(vlm, enable_prefix_caching=True, **UNITS),
                         {"prompt_token_ids": turn1, "multi_modal_data": {"image": a}})  # fmt: skip
    # The answer goes back as text (a generated placeholder id would read as one more image).
    turn2 = turn1 + [t if t != PH else 30 for t in first] + [30, 31, 32, 33, 34, 35]
    tap = LogitTap(warm)
    hit, out_hit = _generate(warm, {"prompt_token_ids": turn2, "multi_modal_data": {"image": a}})
    image_unit_start = (6 // 4) * 4
    assert out_hit.num_cached_tokens > image_unit_start + 4  # the hit covers the image's units
    cold = make_engine(vlm, enable_prefix_caching=False, **UNITS)
    cold_tap = LogitTap(cold)
    ref, _ = _generate(cold, {"prompt_token_ids": turn2, "multi_modal_data": {"image": a}})
    assert hit == ref
    hit_rows, ref_rows = torch.stack(next(iter(tap.rows.values()))), torch.stack(next(iter(cold_tap.rows.values())))
    torch.testing.assert_close(hit_rows, ref_rows, rtol=1e-4, atol=1e-4)
    other, out_other = _generate(warm, {"prompt_token_ids": turn2, "multi_modal_data": {"image": b}})
    assert out_other.num_cached_tokens <= image_unit_start
    assert warm.manager.stats.state_hit_tokens == out_hit.num_cached_tokens + out_other.num_cached_tokens
    alone, _ = _generate(make_engine(vlm, **UNITS), {"prompt_token_ids": turn2, "multi_modal_data": {"image": b}})
    assert other == alone and other != hit


class _FixedDrafts:
    """A proposer that always drafts the same tokens, placeholder ids among them (plain text tokens once drafted)."""

    def __call__(self, req, room: int) -> list[int]:
        return [PH, 5, 9][:room]

    def update(self, req, drafted: int, accepted: int) -> None:
        pass

    def release(self, req) -> None:
        pass


def test_speculative_decoding_stays_text_only(vlm):
    """Drafts extend the sequence past the prompt, where no image rows are: verify forwards carry none, and the
    greedy tokens equal plain decoding."""
    prompt = {"prompt_token_ids": [256, 5, 9, PH, 17, 40, 5, 9], "multi_modal_data": {"image": _noise(3)}}
    plain, _ = _generate(make_engine(vlm, **UNITS), prompt, 8)
    spec = make_engine(vlm, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **UNITS)
    spec.proposer = _FixedDrafts()
    drafted, _ = _generate(spec, prompt, 8)
    assert drafted == plain and spec.spec_stats.drafted > 0, spec.spec_stats


def test_text_only_hashes_unchanged():
    from openk3.serve.kv.prefix import chain_hashes

    tokens = list(range(12))
    assert chain_hashes(tokens, 4, [], images=()) == chain_hashes(tokens, 4, [])
    keyed = chain_hashes(tokens, 4, [], images=[(5, 7, b"k" * 32)])
    plain = chain_hashes(tokens, 4, [])
    assert keyed[0] == plain[0] and keyed[1] != plain[1] and keyed[2] != plain[2]


def test_preemption_recompute_reapplies_image_rows(vlm):
    """A request preempted mid-prefill recomputes from scratch with its image rows again (same tokens)."""
    prompt = [256, 5, 9, PH, 17, 40]
    images = [_image("image0_100x70.png")]
    ref, clear = _reference(vlm, prompt, images, 4)
    engine = make_engine(vlm, max_num_batched_tokens=4, **UNITS)
    rid = engine.add_request({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}},
                             SamplingParams(max_tokens=4, ignore_eos=True))  # fmt: skip
    engine.step()
    engine.step()  # 8 of 17 prompt tokens computed: inside the image rows
    req = engine.requests[rid][0]
    assert 0 < req.num_computed < 15
    engine.scheduler._preempt(StepPlan(), req)
    done = run_to_end(engine)
    assert req.num_preemptions == 1 and done[rid][:clear] == ref[:clear]


# ---- the server ----------------------------------------------------------------------------------------------


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def _header_only_png(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and that has no pixel data: refused from the header alone."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")  # fmt: skip


def _chat(image_parts: list[dict], text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *image_parts]}]


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vision_server(vlm):
    tok = bpe_tokenizer(512, 256, 258, 511)
    engine = LLMEngine(vlm, tok, ServeConfig.from_options(**dict(UNITS, max_model_len=512)))
    llm = AsyncLLM(engine, max_waiting=16)
    app = build_app(llm, "tiny-vl", XTMLChatTemplate(tok), max_images_per_request=2, max_image_pixels=5000)
    with serve_on_loopback(app) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), engine
    llm.shutdown()


def test_server_data_url_image_chat(vision_server):
    client, _ = vision_server
    url = _data_url(_png(_image("image1_56x56.png")))
    resp = client.chat.completions.create(model="tiny-vl", messages=_chat([_part(url)]), max_tokens=3,
                                          temperature=0)  # fmt: skip
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    again = client.chat.completions.create(model="tiny-vl", messages=_chat([{"type": "image", "image": url}]),
                                           max_tokens=3, temperature=0)  # fmt: skip
    assert again.usage.prompt_tokens == resp.usage.prompt_tokens  # 4 image rows in both


@pytest.mark.parametrize("parts, needle, param", [
    ([_part("https://example.com/cat.png")], "only data URLs", "messages.0.content.1.image_url"),
    ([_part("data:image/png;base64,@@not base64@@")], "not valid base64", "messages.0.content.1.image_url"),
    ([_part(_data_url(b"just some text, no image"))], "not a recognised image", "messages.0.content.1.image_url"),
    ([_part(_data_url(_png(_image("image0_100x70.png"))))], "exceeds the limit", "messages.0.content.1.image_url"),
    ([_part(_data_url(_header_only_png(10_000, 10_000)))], "exceeds the limit", "messages.0.content.1.image_url"),
    ([_part(_data_url(_png(_noise(i)))) for i in range(3)], "3 images exceed the limit of 2", "messages"),
])  # fmt: skip
def test_server_refuses_bad_images_with_400(vision_server, parts, needle, param):
    client, _ = vision_server
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny-vl", messages=_chat(parts), max_tokens=2)
    err = info.value
    assert err.status_code == 400
    assert needle in err.body["message"] and err.body["param"] == param and err.body["type"] == "invalid_request_error"
    ok = client.chat.completions.create(model="tiny-vl", messages=_chat([]), max_tokens=1)  # still serving
    assert ok.choices


def test_text_only_server_and_plain_format_refuse_images(vlm):
    tok = bpe_tokenizer(512, 256, 258, 511)
    url = _data_url(_png(_noise(0)))
    text_model = K3ForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    for model, template, needle in ((text_model, XTMLChatTemplate(tok), "text-only"),
                                    (vlm, PlainChatTemplate(tok), "image inputs")):  # fmt: skip
        llm = AsyncLLM(LLMEngine(model, tok, ServeConfig.from_options(**UNITS)), max_waiting=4)
        with serve_on_loopback(build_app(llm, "m", template)) as base:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="m", messages=_chat([_part(url)]), max_tokens=1)
            assert needle in info.value.body["message"]
            assert info.value.body["param"] == "messages.0.content.1" + (".image_url" if needle == "text-only" else "")
        llm.shutdown()


def test_llm_chat_with_images_equals_the_full_multimodal_forward(vlm):
    """`LLM.chat` takes the server's image parts: the data URLs are decoded, the XTML prompt gets one media block
    per image, and the greedy tokens equal the full multimodal forward on that prompt (one placeholder per image,
    expanded by the model). Bad parts are ValueErrors naming the part, as the server's 400s do."""
    tok = bpe_tokenizer(512, 256, 258, 511)
    template = XTMLChatTemplate(tok)
    llm = LLM(vlm, tokenizer=tok, **dict(UNITS, max_model_len=512))
    llm._chat_template = template  # the bare BPE has no chat format of its own
    images = [_image("image0_100x70.png"), _image("image2_45x90.png")]
    messages = _chat([_part(_data_url(_png(im))) for im in images], text="compare")
    prompt = chat_request({"messages": messages}).encode(template, [image_prompt(im) for im in images])
    assert prompt.count(PH) == 2
    ref, clear = _reference(vlm, prompt, images, 6)
    assert clear >= 2, "the chat prompt must have clear margins"
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.outputs[0].token_ids[:clear] == ref[:clear]
    rows = sum(num_image_tokens(g) for g in preprocess(images)[1])
    assert len(out.prompt_token_ids) == len(prompt) - 2 + rows
    bad = [([_part("https://example.com/cat.png")], "content.1.image_url: only data URLs"),
           ([_part(_data_url(b"no image here"))], "content.1.image_url: .*not a recognised image")]  # fmt: skip
    for parts, needle in bad:
        with pytest.raises(ValueError, match=needle):
            llm.chat(_chat(parts))
    llm.max_image_pixels = 5000
    with pytest.raises(ValueError, match="content.1.image_url: .*exceeds the limit"):
        llm.chat(_chat([_part(_data_url(_png(images[0])))]))
    text_only = LLM(K3ForCausalLM.from_pretrained(CKPT, dtype=torch.float32), tokenizer=tok, **UNITS)
    text_only._chat_template = template
    with pytest.raises(ValueError, match="content.1.image_url: this model is text-only"):
        text_only.chat(messages)
