"""From a config to a trained, logged and checkpointed run: schemas, validation, the loop and the CLI."""
