"""The engines' per-token logprobs (token ids and numbers) as OpenAI's `logprobs` objects.

completions:  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}], "text_offset": [...]}
chat:         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's text is its own decoding (special tokens spelled out); its bytes are the bytes it stands
for, which for a byte-level BPE token that is part of a multi-byte character are not valid UTF-8
on their own (why chat gives `bytes`). Completions' `top_logprobs` hold the chosen token too, as
OpenAI's and vLLM's do, and `text_offset` counts characters from the start of the returned text
(the echoed prompt included). A stream's chunks each carry the logprobs of the tokens that arrived
with them: joined, they are the unary answer's.
"""
from __future__ import annotations

from functools import lru_cache

from services.gateway.protocol.openai_format import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from services.rpc.hybridserve.v1 import engine_pb2 as pb


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable characters standing for the 256 bytes), reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append((chr(b), b))
        else:
            chars.append((chr(256 + extra), b))
            extra += 1
    return dict(chars)


class TokenTexts:
    """Each token id's text and bytes under one tokenizer, cached (a tokenizer call costs ~10 µs)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def of(self, token: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token)
        if hit is None:
            text = self.tok.decode([token], skip_special_tokens=False)
            raw = self.tok.convert_ids_to_tokens(token) or ""
            decoder = _byte_decoder()
            if raw and all(ch in decoder for ch in raw) and "\ufffd" in text:
                data = [decoder[ch] for ch in raw]  # a piece of a character: the bytes themselves
            else:
                data = list(text.encode("utf-8"))
            hit = self._cache[token] = (text, data)
            if len(self._cache) > 100_000:
                self._cache.clear()
        return hit


Entry = tuple[int, "pb.TokenLogprob | None"]  # a token id and its logprobs (None: the prompt's first)


class LogprobsWriter:
    """One choice's logprobs, in the shape of its endpoint; `offset`: where its next token's text starts."""

    def __init__(self, texts: TokenTexts, chat: bool, offset: int = 0):
        self.texts, self.chat, self.offset = texts, chat, offset

    def format(self, entries: list[Entry]) -> CompletionLogprobs | ChatLogprobs:
        return self._chat(entries) if self.chat else self._completion(entries)

    def _completion(self, entries: list[Entry]) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for token, lp in entries:
            text = self.texts.of(token)[0]
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(lp.logprob)
            top = {self.texts.of(t)[0]: v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
            top.setdefault(text, lp.logprob)
            out.top_logprobs.append(top)
        return out

    def _chat(self, entries: list[Entry]) -> ChatLogprobs:
        content = []
        for token, lp in entries:
            text, data = self.texts.of(token)
            top = [TopLogprob(token=self.texts.of(t)[0], logprob=v, bytes=self.texts.of(t)[1])
                   for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
            content.append(ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=data, top_logprobs=top))
        return ChatLogprobs(content=content)
