"""A Hugging Face causal LM trained by fdp's recipe on Python's own sources (see ../README.md)."""
