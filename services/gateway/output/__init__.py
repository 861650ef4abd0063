"""Tokens back into text: incremental detokenizing, stop strings, logprobs in OpenAI's shapes, one
choice's text as its tokens arrive. Reads protocol/ only."""
