"""Incremental detokenization for streams: emit text only once it is whole.

Decoding token by token breaks multi-byte characters and merges; we decode a
short window of recent tokens and emit the new suffix once it no longer ends in
a replacement character.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # ids before this are settled
        self._read_offset = 0  # text of ids[_prefix_offset:_read_offset] is already emitted

    def add(self, token: int) -> str:
        """Append one token; the newly complete text (possibly empty)."""
        self.ids.append(token)
        prefix = self.tok.decode(self.ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip)
        full = self.tok.decode(self.ids[self._prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """Whatever is left at the end of the stream, even an incomplete character."""
        full = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest
