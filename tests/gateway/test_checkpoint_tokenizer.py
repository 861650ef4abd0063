"""The gateway's tokenizer and chat template come from the checkpoint it serves: a directory's own
template is the one applied, and a checkpoint without one (a base model such as GPT-2) answers chat
requests with a 400 naming `messages`, not a made-up template or a 500. In process, no engines."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.model.tiny_checkpoints import family_config

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"


def tokenizer_dir(path, tokenizer, family: str, template: str | None):
    """A checkpoint directory as the gateway reads it: config.json and the tokenizer files, the chat
    template replaced (template) or removed (None). The gateway never reads the weights."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(family_config(family).to_dict()))
    tokenizer.save_pretrained(path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_a_directorys_own_chat_template_is_applied(tmp_path, tokenizer):
    from services.model.checkpoint import locate
    from services.model.tokenizer import chat_prompt_ids, load_tokenizer

    tok = load_tokenizer(locate(tokenizer_dir(tmp_path / "qwen2-tiny", tokenizer, "qwen2", TEMPLATE)))
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<<user>>hi"


@pytest.fixture
def gpt2_gateway(tmp_path, tokenizer):
    from services.gateway.api.app import create_app
    from services.gateway.settings import GatewaySettings

    path = tokenizer_dir(tmp_path / "gpt2-tiny", tokenizer, "gpt2", None)
    # engines at a port nothing listens on: the chat request must fail before any engine is asked
    settings = GatewaySettings(model=str(path), prefill_address="127.0.0.1:1", decode_address="127.0.0.1:1")
    with TestClient(create_app(settings)) as client:
        yield client


def test_chat_without_a_template_is_a_400_naming_messages(gpt2_gateway):
    r = gpt2_gateway.post("/v1/chat/completions",
                          json={"model": "gpt2-tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "no chat template" in err["message"]
