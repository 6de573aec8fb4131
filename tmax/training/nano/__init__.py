"""The nano recipe's pieces: a tiny Qwen3 model + tokenizer (`model`) and generated
Harbor-format terminal tasks (`tasks`)."""
