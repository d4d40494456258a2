"""fdp.update.base."""
