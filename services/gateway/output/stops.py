"""Stop strings applied to the generated text, also across streamed chunks."""
from __future__ import annotations


class StopMatcher:
    """Feed text as it is detokenized; get back what may be shown and whether a stop string ended it.

    Text that could be the start of a stop string is held back until it is clear.
    """

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = stops
        self.include = include  # the stop string stays at the end of the text (vLLM's include_stop_str_in_output)
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        hits = [(i, -len(s)) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            at, minus_len = min(hits)  # the earliest; of two there, the longer, as the text reads
            return buf[: at - minus_len] if self.include else buf[:at]
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
