"""The OpenAI surface as data: request bodies (schemas), response and chunk models (openai_format),
the OpenAI error JSON and the one gRPC -> HTTP table (errors), response_format -> grammar (structured),
tool calls (tools). Depends on nothing else in the gateway."""
