"""The demo model: a small vision-language qwen35moe (with its MTP block) trained from scratch on generated data.

`data` writes the pictures and conversations, `bpe` trains the vocabulary, `hybrid` and `model` hold the torch
definitions that mirror the C engine and the vision encoder, `train` trains both, and `export` writes the two GGUF
files.
"""
