"""Tokenizer and chat template, loaded offline through `transformers` from the checkpoint itself: a
GGUF file's tokenizer.* metadata (its chat template included) or a Hugging Face directory's tokenizer
files (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
from __future__ import annotations

import logging
import os
import time

from services.model.checkpoint import Checkpoint, CheckpointError

log = logging.getLogger(__name__)


def load_tokenizer(ckpt: Checkpoint):
    # Never reach for a hub: weights and tokenizer come from the checkpoint on disk.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    start = time.perf_counter()
    try:
        if ckpt.kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    except Exception as exc:  # transformers raises many types for unreadable tokenizers
        raise CheckpointError(f"cannot load the tokenizer of {ckpt.path}: {exc}") from exc
    log.info("tokenizer loaded in %.2fs", time.perf_counter() - start)
    return tok


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template (a base model such as GPT-2): chat requests cannot be formatted."""


def chat_prompt_ids(tok, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of `messages` (and the `tools` the model may call) under the model's chat template, ready
    for the assistant's turn; NoChatTemplate when the checkpoint has none (never a template made up here)."""
    if not getattr(tok, "chat_template", None):
        raise NoChatTemplate("this model's checkpoint has no chat template; send plain text to /v1/completions")
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids
