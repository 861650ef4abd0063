"""Tokenizer and chat template, loaded offline through `transformers` from the checkpoint itself: a
GGUF file's tokenizer.* metadata (its chat template included) or a Hugging Face directory's tokenizer
files (tokenizer.json, tokenizer_config.json, chat_template.jinja).

transformers converts a GGUF file's vocabulary into a fast tokenizer at every load: 7.1 s for the
default model on a 2.1 GHz Xeon, paid by every gateway start (and an engine's first grammar). The
converted tokenizer is kept as its own tokenizer files (JSON, never a pickle) under CACHE, keyed by
the file's size and first 16 MiB (its metadata, the tokenizer's arrays included, comes first), and
read back in 0.3 s; the cache keeps the KEPT newest and is skipped when it cannot be written."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import jinja2

from services.model.checkpoint import Checkpoint, CheckpointError

log = logging.getLogger(__name__)

CACHE = "~/.cache/hybridserve/tokenizers"
KEPT = 16  # converted tokenizers kept (each ~3 MB for the default model)
KEY_BYTES = 16 << 20
# the class names transformers gives the plain tokenizers-library tokenizer (v5, and v4's alias)
FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(ckpt: Checkpoint, cache_dir: str | None = CACHE):
    """The checkpoint's tokenizer; a GGUF file's from `cache_dir` when converted before (None: never cached)."""
    # Never reach for a hub: weights and tokenizer come from the checkpoint on disk.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    start = time.perf_counter()
    cached = _cached_dir(ckpt, cache_dir) if ckpt.kind == "gguf" and cache_dir else None
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            tok = _from_cache(cached)
            log.info("tokenizer loaded in %.2fs (converted before: %s)", time.perf_counter() - start, cached)
            return tok
        except Exception as exc:  # a damaged entry: convert again, and replace it
            log.warning("cached tokenizer %s unreadable (%s): converting the checkpoint's again", cached, exc)
    from transformers import AutoTokenizer

    try:
        if ckpt.kind == "gguf":
            tok = AutoTokenizer.from_pretrained(str(ckpt.path.parent), gguf_file=ckpt.path.name)
        else:
            tok = AutoTokenizer.from_pretrained(str(ckpt.path))
    except Exception as exc:  # transformers raises many types for unreadable tokenizers
        raise CheckpointError(f"cannot load the tokenizer of {ckpt.path}: {exc}") from exc
    log.info("tokenizer loaded in %.2fs", time.perf_counter() - start)
    if cached is not None:
        _keep(tok, cached)
    return tok


def _from_cache(cached: Path):
    """A converted tokenizer read back. What the cache holds is transformers' tokenizers-library
    class (a GGUF conversion's): loaded as that class, not through AutoTokenizer, whose model and
    configuration registry imports torch (3.6 s of CPU at every gateway start against 1.3, the same
    tokenizer: tests/model/test_tokenizer_cache.py)."""
    config = json.loads((cached / "tokenizer_config.json").read_text())
    if config.get("tokenizer_class") in FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(cached))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cached))


def _cached_dir(ckpt: Checkpoint, cache_dir: str) -> Path | None:
    """Where the GGUF file's converted tokenizer is kept: its size, its first KEY_BYTES and the
    transformers version that converted it name it."""
    import transformers

    try:
        with open(ckpt.path, "rb") as f:
            head = f.read(KEY_BYTES)
        size = os.path.getsize(ckpt.path)
    except OSError:
        return None
    key = hashlib.sha256(head + f"|{size}|{transformers.__version__}".encode()).hexdigest()[:32]
    return Path(cache_dir).expanduser() / key


def _keep(tok, cached: Path) -> None:
    """Save the tokenizer's files into `cached` (whole or not at all), then drop the oldest entries
    past KEPT; a cache that cannot be written is left alone."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        try:
            tok.save_pretrained(str(tmp))
            if cached.exists():
                shutil.rmtree(cached)
            tmp.rename(cached)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        entries = sorted((p for p in cached.parent.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in entries[KEPT:]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        log.warning("could not keep the converted tokenizer in %s: %s", cached.parent, exc)


class NoChatTemplate(ValueError):
    """The checkpoint has no chat template (a base model such as GPT-2): chat requests cannot be formatted."""


def text_ids(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text's token ids, as a completion prompt is tokenized (with the tokenizer's special tokens, a BOS
    for some, unless told not)."""
    return tok(text, add_special_tokens=add_special_tokens).input_ids


def ids_text(tok, ids: list[int]) -> str:
    """Token ids back to text, as the tokenizer decodes them."""
    return tok.decode(ids)


class ChatTemplateRefused(ValueError):
    """The chat template would not render these messages: its own `raise_exception` (Qwen3's when no user
    message is found, Mistral's when the roles do not alternate), or a last message it does not write as
    sent, which continue_final_message cannot then leave open. The client's request, not the server."""


def chat_prompt_ids(tok, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
    """Token ids of `messages` (and the `tools` the model may call) under the model's chat template, ready
    for the assistant's turn (or, continue_final_message, inside the last message's); NoChatTemplate when
    the checkpoint has none (never a template made up here), ChatTemplateRefused when it refuses them."""
    if not getattr(tok, "chat_template", None):
        raise NoChatTemplate("this model's checkpoint has no chat template; send plain text to /v1/completions")
    try:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message)
    except jinja2.TemplateSyntaxError:
        raise  # the checkpoint's template is broken: the server's fault, not the request's
    except jinja2.TemplateError as exc:
        raise ChatTemplateRefused(f"the model's chat template refused these messages: {exc}") from None
    except ValueError as exc:
        raise ChatTemplateRefused(str(exc)) from None
    return tok(text, add_special_tokens=False).input_ids
