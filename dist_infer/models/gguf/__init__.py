"""GGUF checkpoints: reading the file, checking it before trusting it, dequantizing its tensors, its
tokenizer, and loading it into the model's stages. Torch-free to import (the reader runs in launchers)."""
