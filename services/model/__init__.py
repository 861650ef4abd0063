"""Checkpoints and what is read from them: locating a checkpoint, its config, weights (dense and
GGUF blocks), the loaded model bundle, and the tokenizer with its chat template."""
