"""Which grammar library to use for structured outputs: xgrammar, llguidance and outlines-core, measured
on the default model's tokenizer (49,152 tokens).

For each library and each grammar (a small JSON schema, strict and without free whitespace; any JSON
object; a regex) it times:

* setup: the library's view of the tokenizer, built once per process;
* compile: the grammar for that tokenizer (cold, then again: what a cache returns);
* fill: the token bitmask for the next position, at every position of a valid output
  (the model's own tokenization of a valid document), one matcher;
* accept: advancing the matcher by that position's token;
* fill x8: the masks of 8 matchers at one step (the library's batch call where it has one);
* apply: the bitmask applied to 8 rows of fp32 logits in numpy (-inf where a token is not allowed);
* request: what one request with a grammar not seen before costs: compile (cold) + a fill and an
  accept per token of the document.

A library that cannot express a grammar says so in the table (outlines-core compiles regular
languages only: no unbounded nesting, so no "any JSON object").

    python -m bench.micro.grammar_libs [--repeats 5] [--libs xgrammar,llguidance,outlines_core]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from bench._common import progress, table, write_json

from services.model.checkpoint import locate
from services.model.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "active"],
    "additionalProperties": False,
}
SCHEMA_DOC = '{"name":"Ada Lovelace","age":36,"tags":["math","poet"],"active":true}'
OBJECT_DOC = '{"a":[1,2,{"b":null}],"c":"text","d":{"e":-1.5e3}}'
REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]) [A-Z][a-z]{2,9}"
REGEX_DOC = "2024-02-29 Leapday"
GRAMMARS = {"json_schema": SCHEMA_DOC, "json_object": OBJECT_DOC, "regex": REGEX_DOC}
BATCH = 8


def ms(seconds: float) -> float:
    return seconds * 1e3


def us(seconds: float) -> float:
    return seconds * 1e6


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, len(tok)
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))

    def compile(self, kind: str):
        # a fresh compiler: its cache would make a second compile free
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json_schema":
            return compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"),
                                                strict_mode=True)
        if kind == "json_object":
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_regex(REGEX)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int):
        return self.xgr.allocate_token_bitmask(rows, self.vocab).numpy()

    def fill(self, matcher, bitmask, row: int = 0):
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def fill_batch(self, matchers, bitmask):
        import torch

        if not hasattr(self, "_batch"):
            self._batch = self.xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg, self.np, self.vocab = llguidance, llguidance.numpy, len(tok)
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.executor = llguidance.LLExecutor()

    def compile(self, kind: str):
        M = self.llg.LLMatcher
        compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        if kind in ("json_schema", "json_object"):
            grammar = M.grammar_from_json_schema(SCHEMA if kind == "json_schema" else {"type": "object"},
                                                 defaults=compact)
        else:
            grammar = M.grammar_from_regex(REGEX)
        # llguidance compiles lazily: building the matcher is the compile (the lexer grows as it goes)
        matcher = M(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled, log_level=0)

    def bitmask(self, rows: int):
        return self.np.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matcher, bitmask, row: int = 0):
        self.np.fill_next_token_bitmask(matcher, bitmask, row)

    def fill_batch(self, matchers, bitmask):
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def done(self, matcher) -> bool:
        return matcher.is_stopped()


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tok):
        import outlines_core

        self.oc, self.vocab = outlines_core, len(tok)
        eos = tok.eos_token_id
        special = set(tok.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        byte_of = _byte_decoder()
        for text, i in tok.get_vocab().items():
            if i in special or i == eos:
                continue
            try:
                key = bytes(byte_of[c] for c in text)
            except KeyError:  # an added token that is not byte-level
                key = text.encode()
            tokens.setdefault(key, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)

    def compile(self, kind: str):
        if kind == "json_object":
            raise NotImplementedError("regular languages only: no unbounded nesting")
        if kind == "json_schema":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), "")
        else:
            regex = REGEX
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def bitmask(self, rows: int):
        return np.full((rows, (self.vocab + 31) // 32), -1, dtype=np.int32)

    def fill(self, matcher, bitmask, row: int = 0):
        v = bitmask[row]
        matcher.write_mask_into(v.ctypes.data, v.size, 4)

    def fill_batch(self, matchers, bitmask):
        for i, m in enumerate(matchers):
            self.fill(m, bitmask, i)

    def accept(self, matcher, token: int) -> bool:
        if token != self.vocabulary.get_eos_token_id():  # EOS is allowed in a final state, not a transition
            matcher.advance(token)
        return True

    def done(self, matcher) -> bool:
        return matcher.is_finished()


LIBS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is written as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def apply_mask(logits: np.ndarray, bitmask: np.ndarray) -> None:
    """-inf where a row's bit is 0 (the way the engines apply it)."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    logits[bits == 0] = -np.inf


def run_one(lib, kind: str, doc_ids: list[int], eos: int, repeats: int) -> dict:
    compile_s = []
    for _ in range(repeats):
        t = time.perf_counter()
        compiled = lib.compile(kind)
        compile_s.append(time.perf_counter() - t)
    fills, accepts, fills8, per_doc = [], [], [], []
    bitmask, bitmask8 = lib.bitmask(1), lib.bitmask(BATCH)
    for _ in range(repeats):
        m = lib.matcher(compiled)
        batch = [lib.matcher(compiled) for _ in range(BATCH)]
        doc_start = len(fills)
        for tok in doc_ids + [eos]:
            t = time.perf_counter()
            lib.fill(m, bitmask)
            fills.append(time.perf_counter() - t)
            allowed = (bitmask[0, tok // 32] >> (tok % 32)) & 1
            assert allowed, f"{lib.name} {kind}: token {tok} masked out"
            t = time.perf_counter()
            ok = lib.accept(m, tok)
            accepts.append(time.perf_counter() - t)
            assert ok, f"{lib.name} {kind}: token {tok} refused"
            t = time.perf_counter()
            lib.fill_batch(batch, bitmask8)
            fills8.append(time.perf_counter() - t)
            for b in batch:
                lib.accept(b, tok)
        per_doc.append(sum(fills[doc_start:]) + sum(accepts[doc_start:]))
        assert lib.done(m) or kind == "regex" or lib.name == "outlines_core", f"{lib.name} {kind}: not terminated"
    logits = np.random.default_rng(0).standard_normal((BATCH, lib.vocab)).astype(np.float32)
    applies = []
    for _ in range(20):
        x = logits.copy()
        t = time.perf_counter()
        apply_mask(x, bitmask8)
        applies.append(time.perf_counter() - t)
    return {"compile_cold_ms": ms(compile_s[0]), "compile_median_ms": ms(statistics.median(compile_s)),
            "fill_us_median": us(statistics.median(fills)), "fill_us_p99": us(float(np.percentile(fills, 99))),
            "accept_us_median": us(statistics.median(accepts)),
            "fill8_us_median": us(statistics.median(fills8)), "fill8_us_p99": us(float(np.percentile(fills8, 99))),
            "apply8_us_median": us(statistics.median(applies)), "tokens": len(doc_ids) + 1,
            # one request: compile, then a fill and an accept per token
            "request_ms": ms(compile_s[0] + statistics.median(per_doc))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--libs", default=",".join(LIBS))
    args = ap.parse_args()
    tok = load_tokenizer(locate(None))
    results: dict = {}
    rows = []
    for name in args.libs.split(","):
        progress(f"{name}: setup")
        t = time.perf_counter()
        try:
            lib = LIBS[name](tok)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        setup_ms = ms(time.perf_counter() - t)
        results[name] = {"setup_ms": setup_ms}
        for kind, doc in GRAMMARS.items():
            progress(f"{name}: {kind}")
            ids = tok(doc, add_special_tokens=False).input_ids
            try:
                r = run_one(lib, kind, ids, tok.eos_token_id, args.repeats)
            except NotImplementedError as exc:
                results[name][kind] = {"unsupported": str(exc)}
                rows.append([name, kind, setup_ms] + ["-"] * 7 + [f"unsupported: {exc}"])
                continue
            results[name][kind] = r
            rows.append([name, kind, setup_ms, r["compile_cold_ms"], r["compile_median_ms"], r["fill_us_median"],
                         r["fill_us_p99"], r["accept_us_median"], r["fill8_us_median"], r["apply8_us_median"], r["request_ms"]])
    print(table(["library", "grammar", "setup ms", "compile ms (cold)", "compile ms (median)", "fill us",
                 "fill us p99", "accept us", "fill x8 us", "apply x8 us",
                 "request ms"], rows))
    write_json("grammar_libs", {"schema": SCHEMA, "regex": REGEX, "docs": GRAMMARS, "batch": BATCH,
                                "vocab": len(tok), "results": results})


if __name__ == "__main__":
    main()
