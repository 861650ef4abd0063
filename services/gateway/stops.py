"""Stop strings applied to the generated text, also across streamed chunks."""
from __future__ import annotations


class StopMatcher:
    """Feed text as it is detokenized; get back what may be shown and whether a stop string ended it.

    Text that could be the start of a stop string is held back until it is clear.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)]
        cut = max(0, len(buf) - self._hold)
        self._pending = buf[cut:]
        return buf[:cut]

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
