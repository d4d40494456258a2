"""The train state: one value holding everything a run carries from step to step.

``TrainState`` (``train_state.py``) holds the params, buffers, optimizer and hook
states, the step, the RNG and what the optional features keep (the moving average, the
outer loop's anchor, ZeRO's mirror of the next rank's slices). Around it: the checks of
what a step is given (``checks.py``), one consistent state on every rank at start
(``replicas.py``), and the state a rank joining a running world receives from its peers
(``heal.py``), and the state before a step kept for a world that may go back to it (``kept.py``).
Import the modules themselves; the public names are re-exported from ``fdp``.
"""
