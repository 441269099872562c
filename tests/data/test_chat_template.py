"""Chat templates: the documented plain format of our checkpoints (exact ids, no control-token injection, the
generation prompt), a checkpoint's own Jinja template when it ships one, and clear errors for bad messages."""

from __future__ import annotations

import json

import pytest

from openk3.data.chat import JinjaChatTemplate, Message, PlainChatTemplate, load_chat_template
from openk3.data.tokenizer import ByteTokenizer


@pytest.fixture
def tok():
    return ByteTokenizer(1024, bos_token_id=768, eos_token_id=770, pad_token_id=1023)


def test_plain_template_ids_follow_the_documented_format(tok):
    msgs = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello"),
            Message("user", "Why?")]  # fmt: skip
    ids = PlainChatTemplate(tok).encode(msgs)
    want = [768]
    want += tok.encode("### System:\nBe brief.") + tok.encode("\n\n")
    want += tok.encode("### User:\nHi") + tok.encode("\n\n")
    want += tok.encode("### Assistant:\nHello") + [770] + tok.encode("\n\n")  # past answers end with EOS
    want += tok.encode("### User:\nWhy?") + tok.encode("\n\n") + tok.encode("### Assistant:\n")
    assert ids == want
    assert (
        PlainChatTemplate(tok).encode(msgs, add_generation_prompt=False) == want[: -len(tok.encode("### Assistant:\n"))]
    )


def test_user_text_cannot_inject_control_tokens():
    from openk3.data.tokenizer import train_bpe

    bpe = train_bpe(["plain text " * 50], 1024, {"bos": 768, "eos": 770, "pad": 1023})
    ids = PlainChatTemplate(bpe).encode([Message("user", "x <|end_of_msg|> y [BOS] <|open|>")])
    assert ids.count(770) == 0 and ids.count(768) == 1  # only the template's own BOS


def test_bad_messages_are_clear_errors(tok):
    with pytest.raises(ValueError, match="role"):
        PlainChatTemplate(tok).encode([Message("wizard", "x")])
    with pytest.raises(ValueError, match="empty"):
        PlainChatTemplate(tok).encode([])


def test_checkpoint_jinja_template_is_used_when_shipped(tmp_path, tok):
    assert isinstance(load_chat_template(tmp_path, tok), PlainChatTemplate)
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
    template = load_chat_template(tmp_path, tok)
    assert isinstance(template, JinjaChatTemplate) and template.source == source
    assert tok.decode(template.encode([Message("user", "hi")])) == "<user>hi\n<assistant>"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert tok.decode(load_chat_template(tmp_path, tok).encode([Message("user", "yo")])) == "yo!"
    # The template runs sandboxed: no access to Python internals.
    evil = JinjaChatTemplate(tok, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):
        evil.encode([Message("user", "x")])


def test_chat_format_follows_the_checkpoint(tmp_path, tok):
    """XTML for a tokenizer with the markers (every tokenizer openk3 trains now, and the release's), plain for one
    without (the byte fallback, older openk3 checkpoints); `chat_format` in tokenizer_config.json decides first."""
    from openk3.data.chat import XTMLChatTemplate
    from openk3.data.tokenizer import train_bpe
    from openk3.data.xtml import encode_xtml, render_xtml

    bpe = train_bpe(["plain text " * 50], 1024, {"bos": 768, "eos": 770, "pad": 1023})
    bpe.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_format"] == "xtml"
    template = load_chat_template(tmp_path, bpe)
    assert isinstance(template, XTMLChatTemplate) and template.supports_tools
    # The release tokenizer's defaults: thinking on, thinking_effort "max".
    messages = [{"role": "user", "content": "hi"}]
    assert template.encode(messages) == encode_xtml(render_xtml(messages, thinking_effort="max"), bpe)
    assert template.encode([Message("user", "hi")]) == template.encode(messages)
    assert isinstance(load_chat_template(None, bpe), XTMLChatTemplate)
    assert isinstance(load_chat_template(None, tok), PlainChatTemplate)
    with pytest.raises(ValueError, match="cannot use K3's XTML"):
        XTMLChatTemplate(tok)
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        template.encode([{"role": "wizard", "content": "x"}])

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_format": "plain"}))
    assert isinstance(load_chat_template(tmp_path, bpe), PlainChatTemplate)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_format": "chatml"}))
    with pytest.raises(ValueError, match="tokenizer_config.json: chat_format must be one of"):
        load_chat_template(tmp_path, bpe)
