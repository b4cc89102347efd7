"""Hugging Face interop: import checkpoints and tokenizers as model artifacts, export back."""
