"""Speculative decoding through the real stack (the shared stack's engines speculate, conftest.py): a
copy-heavy request gives the same text, logprobs and finish in every mode as the same request with
speculation turned off (`speculative: false`), streamed or not, with a stop string and with a schema;
usage says how many drafted tokens the model accepted, and the engines' counters agree."""
from __future__ import annotations

import urllib.request

import pytest

from services.modes import MODE_NAMES
from tests.gateway.test_api_logprobs import post, stream

pytestmark = pytest.mark.slow

TEXT = ("The river runs past the old mill, under the stone bridge and into the valley where the farmers "
        "keep their sheep.")
COPY = [{"role": "user", "content": f"Repeat this sentence three times, exactly: {TEXT}"}]


def accepted_total(service) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("hybridserve_spec_decode_num_accepted_tokens_total"))


def test_drafts_change_no_token_in_any_mode_and_usage_counts_the_accepted_ones(stack):
    before = accepted_total(stack["decode"]) + accepted_total(stack["prefill"])
    body = {"messages": COPY, "max_tokens": 64, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    texts = {}
    for mode in MODE_NAMES:
        on = post(stack, "/v1/chat/completions", {**body, "mode": mode})
        off = post(stack, "/v1/chat/completions", {**body, "mode": mode, "speculative": False})
        assert on["choices"][0]["message"] == off["choices"][0]["message"], mode
        assert on["choices"][0]["finish_reason"] == off["choices"][0]["finish_reason"]
        tokens_on = [(t["token"], t["top_logprobs"][0]["token"]) for t in on["choices"][0]["logprobs"]["content"]]
        tokens_off = [(t["token"], t["top_logprobs"][0]["token"]) for t in off["choices"][0]["logprobs"]["content"]]
        assert tokens_on == tokens_off, mode
        lp_on = [t["logprob"] for t in on["choices"][0]["logprobs"]["content"]]
        lp_off = [t["logprob"] for t in off["choices"][0]["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off)) < 1e-3, mode
        assert "completion_tokens_details" not in off["usage"]  # turned off: nothing was drafted
        details = on["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0, (mode, on["usage"])
        assert on["hybridserve"]["timings"]["accepted_draft_tokens"] == details["accepted_prediction_tokens"]
        texts[mode] = on["choices"][0]["message"]["content"]
    assert len(set(texts.values())) == 1, texts
    assert accepted_total(stack["decode"]) + accepted_total(stack["prefill"]) > before


def test_a_streamed_stop_string_and_a_schema_end_where_they_do_without_drafts(stack):
    for mode in ("fpga", "hybrid"):
        body = {"messages": COPY, "max_tokens": 64, "temperature": 0, "stop": ["bridge"], "mode": mode}
        events = [stream(stack, "/v1/chat/completions", {**body, "speculative": s}) for s in (True, False)]
        texts = ["".join(ch["delta"].get("content") or "" for e in ev for ch in e["choices"]) for ev in events]
        assert texts[0] == texts[1] and "bridge" not in texts[0] and texts[0], (mode, texts)
        assert events[0][-1]["choices"][0]["finish_reason"] == "stop"
    schema = {"type": "object", "properties": {"sentence": {"type": "string"}}, "required": ["sentence"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"messages": [{"role": "user", "content": f"Give this sentence as JSON: {TEXT} {TEXT}"}],
            "max_tokens": 80, "temperature": 0, "response_format": fmt, "mode": "fpga"}
    on, off = (post(stack, "/v1/chat/completions", {**body, "speculative": s}) for s in (True, False))
    assert on["choices"][0] == off["choices"][0]
