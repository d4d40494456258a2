"""Your own code in the loop: callbacks the loop calls at its points, each with a read-only view of the run.

A callback is an object with any of these methods (``Callback`` has them all, doing nothing):

* ``on_step_end(event)``: after every step, with the step's metrics (this rank's: ``loss`` is its share's);
* ``on_evaluation_end(event)``: after each evaluation, with its record (rank 0's on every rank: ``val_loss``...);
  the evaluations every run of the settings makes (not the one closing a ``trainer.stop_at`` invocation);
* ``on_save(event)``: once a checkpoint is complete, ``event.checkpoint`` its path (with the whole-file format
  only rank 0's is known: ``None`` on the others; an asynchronous sharded write is waited for first);
* ``on_run_end(event)``: once the loop is done (the last step, a stop or a signal), the summary as its metrics.

Where it runs: rank 0 only, unless it declares ``every_rank = True``. What it keeps across a resume:
``state_dict()`` (plain values and tensors) is saved in every checkpoint, either format, and handed back to
``load_state_dict(state)`` on resume, so a resumed run's callback goes on as the uninterrupted one's (an
``every_rank`` callback's by rank; on a world of another size every rank gets rank 0's). A checkpoint holds
the state from before its own ``on_save``. A run with a callback that keeps state and hears evaluations
evaluates a step before it checkpoints it, as early stopping's does (``fdp.run.loop``).

Chosen from the config, as models and hooks are (``fdp.targets``):
``trainer.callbacks=[{_target_: my_pkg.callbacks.Log, every: 10}]``, or from Python:
``fdp.run.trainer.run(cfg, run_dir, callbacks=[Log(every=10)])`` (a local world pickles them into its ranks).

What a callback sees (``LoopEvent``) is read-only: ``state`` is this rank's ``TrainState`` with its mappings
frozen (``MappingProxyType``) and its lists made tuples; its tensors are the loop's own, and an in-place write
to one of them or to a metric (caught by the tensors' version counters, what autograd uses) ends the run as an
exception does. Writes that bypass the counters (``tensor.data``, a numpy view) go unseen: don't make them.
The loop updates the tensors in place at the next step: ``clone()`` what you keep. At ZeRO stage 3
``state.params`` are this rank's flat slices by bucket (``bucket0``...); ``event.whole_params()`` gathers them
whole by name (a collective: call it on every rank, from an ``every_rank`` callback). A callback that raises
ends the run with one line, ``CallbackError``, naming it and the event (the recipe: exit 2; the traceback
goes to ``train.log``).

The package: what a callback is and what it is shown (``base``), callbacks from the config (``specs``), the
read-only view (``view``), and the run's callbacks as the loop calls them, with their state in checkpoints
(``calls``).
"""

from fdp.run.callbacks.base import Callback, CallbackError, LoopEvent
from fdp.run.callbacks.calls import Callbacks, check_given
from fdp.run.callbacks.specs import build_callbacks, check_callbacks

__all__ = ["Callback", "CallbackError", "LoopEvent", "Callbacks", "check_given", "build_callbacks", "check_callbacks"]
