"""The HTTP surface: the app factory and its routes, auth, body limits, drain, OpenAPI, tokenize,
debug and pool admin routes, readiness, the uvicorn server. The top of the gateway: it wires the
rooms below together."""
