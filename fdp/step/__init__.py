"""fdp.step.train_step."""
