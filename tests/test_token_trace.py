"""services/token_trace.py: off unless configured; a request's hops and the steps written as JSON lines."""
from __future__ import annotations

import json

from services import token_trace


def test_records_go_to_the_process_file_once_the_request_is_flushed(tmp_path, monkeypatch):
    monkeypatch.setattr(token_trace, "ON", False)
    token_trace.configure(None, "gateway")
    assert token_trace.ON is False  # unset: nothing is traced
    monkeypatch.setattr(token_trace, "_path", None)
    token_trace.configure(str(tmp_path), "gateway")
    assert token_trace.ON
    token_trace.step(1.0, 1.5, 2)
    token_trace.mark("r1", "recv", 1, t=2.0)
    token_trace.mark("r1", "sse", 1, t=2.5)
    assert not list(tmp_path.glob("*.jsonl"))  # nothing written per token
    token_trace.flush("r1")
    lines = [json.loads(x) for f in tmp_path.glob("gateway-*.jsonl") for x in f.read_text().splitlines()]
    assert {"rid": "r1", "hop": "recv", "n": 1, "t": 2.0} in lines and {"step": [1.0, 1.5, 2]} in lines
    assert len(lines) == 3
