"""What a model computes: modules as pure functions, built-in models, losses, precision, random streams."""
