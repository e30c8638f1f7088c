"""The demo model: a small vision-language qwen3moe trained from scratch on generated data.

`data` writes the pictures and conversations, `bpe` trains the vocabulary, `model` holds the torch definitions that
mirror the C engine and the vision encoder, `train` trains both, and `export` writes the two GGUF files.
"""
