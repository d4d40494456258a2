"""A user's own model and data, trained by fdp's recipe without touching fdp (see ../README.md)."""
