"""From a config to a trained, logged and checkpointed run: schemas, validation, the loop and the CLI.

Its components: the configuration (``config``: schemas, keys, compose, validate), the start of a run and of each
rank, and its pieces (``startup``, ``world``, ``build``), the loop and a rank's run (``loop``, ``loop_controls``,
``monitor``, ``callbacks`` (a package), ``trainer``, ``rejoin``), checkpoints (``checkpoint``: one package, whose
``Checkpointer`` owns save, resume, wait and prune for both formats), what a lost rank does (``rank_loss``),
reporting (``report``: records, metrics and loggers; ``evaluate``, ``rundir``), memory (``memory``: the
forecast, automatic micro-batches and stage, out of memory) and the shell (``cli``, ``reference``,
``compatibility``, ``sweep``). The map in ``fdp/__init__.py`` says each one's role.
"""
