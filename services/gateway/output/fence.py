"""The markdown fence around JSON output, taken off the text the client gets.

With JSON output asked for (`response_format` json_object or json_schema, vLLM's guided_json), the
grammar lets the model open its answer with "```json" and a newline and close it with a newline and
"```", as chat models write JSON by habit (structured.py says why). The client gets the JSON alone:

* a text that could still be the opening fence is held back until it is clear, then dropped (it is the
  fence) or given out (the model began with the JSON itself: nothing more is held from then on);
* inside a fence, a newline and backticks are held until it is clear they are not the closing fence.
  JSON has no raw newline inside its strings and no backtick outside them, so a newline followed by a
  backtick can only start the closing fence: from there on nothing is given out.

The tokens of the fence still count in `usage` and appear in logprobs, as the model made them.
"""
from __future__ import annotations

OPEN = "```json\n"
CLOSE = "\n```"


class FenceStripper:
    """Feed the detokenized text; get back what the client sees. `flush` at the end of the output."""

    def __init__(self):
        self._held = ""
        self._fenced: bool | None = None  # None: the opening fence is not yet ruled in or out
        self._closed = False

    def feed(self, text: str) -> str:
        if self._closed:
            return ""
        buf, self._held = self._held + text, ""
        if self._fenced is None:
            if len(buf) < len(OPEN) and OPEN.startswith(buf):
                self._held = buf
                return ""
            self._fenced = buf.startswith(OPEN)
            if not self._fenced:
                return buf
            buf = buf[len(OPEN):]
        if not self._fenced:
            return buf
        at = buf.find(CLOSE)
        if at >= 0:
            self._closed = True
            return buf[:at]
        keep = next((n for n in range(min(len(CLOSE) - 1, len(buf)), 0, -1) if CLOSE.startswith(buf[-n:])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """The end of the output: what is still held is a fence cut short (or, inside a fence, a trailing
        newline), so none of it is the JSON's."""
        self._held = ""
        return ""
