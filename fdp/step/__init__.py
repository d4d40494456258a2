"""The pure train step, ``state, batch -> state, metrics``, and what runs inside it.

``train_step.py`` reads top to bottom: gradients of the loss, their reduction bucket by
bucket (``reduce.py``, the hook chains each bucket runs through in ``chains.py``), each
finished bucket handed to the update, and the step's one verdict on finiteness
(``verdicts.py``). ``compiled.py`` puts the gradient under ``torch.compile``; ``outer.py``
wraps the step in local SGD or (streaming) DiLoCo, with its settings and schedule in
``outer_spec.py``. Import the modules themselves; the public names are re-exported from ``fdp``.
"""
