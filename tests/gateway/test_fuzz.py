"""The API fuzzed from its own OpenAPI document (schemathesis, stateless) on the live stack.

Every operation gets a bounded, derandomized set of generated requests, valid and invalid ones.
Each answer must not be a 5xx and must be what the document declares: a declared status, a
declared content type, a body that matches the declared schema (errors included).

Generation stays cheap: the requests that would run the model ask for at most 4 tokens and name
the served model (a random name is a 404, which the other tests cover).
"""
from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from services.gateway.api.app import create_app
from services.gateway.settings import GatewaySettings
from tests.gateway.conftest import API_KEY, MODEL

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 50  # per operation
CHEAP_TOKENS = 4
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
statuses: Counter = Counter()  # status -> answers, over the whole module


def map_body(context, body):
    """Keep generated bodies cheap to serve: the served model, few tokens (values past the window stay)."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and CHEAP_TOKENS < value <= 4096:
            body[key] = CHEAP_TOKENS
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = CHEAP_TOKENS  # the chat default would be 1024 tokens
    # a client's own deadline of a few microseconds is answered 504 as documented (a deadline the
    # client set, not a server error); the fuzz is about the server's own answers
    if isinstance(body.get("timeout"), (int, float)) and not isinstance(body["timeout"], bool) \
            and 0 < body["timeout"] < 60:
        body["timeout"] = 60
    return body


# The document as the gateway builds it (the same code answers /openapi.json on the stack, which the
# test compares); loaded here, at collection, because schemathesis parametrizes from it then.
DOCUMENT = create_app(GatewaySettings(api_key=API_KEY)).openapi()
schema = schemathesis.openapi.from_dict(DOCUMENT)
schema.config.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)
schema.hook(map_body)


@pytest.fixture(scope="module")
def live(stack):
    served = httpx.get(stack["url"] + "/openapi.json", headers=AUTH, timeout=30).json()
    assert served == DOCUMENT  # what is fuzzed is what the stack serves
    yield stack["url"]
    print(f"\nfuzz: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_every_answer_as_documented(case, live):
    response = case.call(base_url=live, headers=AUTH, timeout=120)
    statuses[response.status_code] += 1
    case.validate_response(response, checks=CHECKS, headers=AUTH)
