"""The converted-tokenizer cache (services/model/tokenizer.py) on the default GGUF: read back, it
tokenizes, templates and decodes as the conversion did; a damaged entry is converted again and
replaced; a cache that cannot be written is skipped."""
from __future__ import annotations

import json

from services.model.tokenizer import _cached_dir, _keep, load_tokenizer

TEXTS = ("Hello world!", "<|im_start|>user\nWhat is 2+2?<|im_end|>", "ünïcödé 🙂 tabs\tand  spaces", "")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
    ids = a(TEXTS[2]).input_ids + [1, 2, 100, 4000]
    assert a.decode(ids) == b.decode(ids)
    assert (a.bos_token_id, a.eos_token_id, len(a)) == (b.bos_token_id, b.eos_token_id, len(b))
    assert a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_a_converted_tokenizer_comes_back_from_the_cache_alike(loaded_model, tmp_path):
    ckpt = loaded_model.checkpoint
    converted = load_tokenizer(ckpt, str(tmp_path))
    entry = _cached_dir(ckpt, str(tmp_path))
    assert (entry / "tokenizer.json").is_file()
    json.loads((entry / "tokenizer.json").read_text())  # JSON files, nothing to unpickle
    assert not list(tmp_path.glob(".tmp-*"))  # written whole, through a renamed folder
    same_tokenizer(converted, load_tokenizer(ckpt, str(tmp_path)))


def test_a_damaged_entry_is_converted_again_and_replaced(loaded_model, tokenizer, tmp_path):
    ckpt = loaded_model.checkpoint
    entry = _cached_dir(ckpt, str(tmp_path))
    entry.mkdir(parents=True)
    (entry / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    same_tokenizer(load_tokenizer(ckpt, str(tmp_path)), tokenizer)
    json.loads((entry / "tokenizer.json").read_text())


def test_a_cache_that_cannot_be_written_is_skipped(tokenizer, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _keep(tokenizer, blocker / "entry")  # its parent is a file: mkdir fails, nothing raises
    assert blocker.is_file()
