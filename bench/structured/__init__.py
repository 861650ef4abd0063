"""The structured-outputs evaluation's parts (bench/structured_eval.py): the prompts (prompts.jsonl),
the requests and their streamed client, the scoring, the report (as `bench.structured.*`)."""
