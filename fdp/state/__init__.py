"""fdp.state.train_state."""
