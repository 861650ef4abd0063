"""From a routed request to tokens: the request as the gateway routes it, the Dispatcher (route,
place, call, retry), the open call and its migration (engine_stream), the serving loop, several
prompts in one request."""
