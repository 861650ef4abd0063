"""The converted-tokenizer cache (services/model/tokenizer.py) on the default GGUF: read back, it
tokenizes, templates and decodes as the conversion did, in a process that never imports torch (the
gateway's); a damaged entry is converted again and replaced; a cache that cannot be written is skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from services.model.tokenizer import _cached_dir, _keep, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

TEXTS = ("Hello world!", "<|im_start|>user\nWhat is 2+2?<|im_end|>", "ünïcödé 🙂 tabs\tand  spaces", "")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def same_tokenizer(a, b) -> None:
    for text in TEXTS:
        assert a(text).input_ids == b(text).input_ids, text
    ids = a(TEXTS[2]).input_ids + [1, 2, 100, 4000]
    assert a.decode(ids) == b.decode(ids) and a.convert_ids_to_tokens(ids) == b.convert_ids_to_tokens(ids)
    assert type(a) is type(b) and a.all_special_ids == b.all_special_ids
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


# the gateway's start: the tokenizer of the default model, then whether torch came with it
SCRIPT = """
import json, sys
from services.model.loading import locate
from services.model.tokenizer import load_tokenizer
tok = load_tokenizer(locate(None), sys.argv[1])
print(json.dumps({"torch": "torch" in sys.modules, "ids": tok("Hello world!").input_ids}))
"""


def test_a_process_that_finds_the_tokenizer_cached_never_imports_torch(tmp_path):
    def run() -> dict:
        r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first, second = run(), run()  # the first converts the GGUF's vocabulary (transformers' GGUF path: torch)
    assert not second["torch"] and second["ids"] == first["ids"]
