"""``python -m torch.distributed.run ARGS...`` as a script file, so that tests/_recipe.py can fork it from the
preloaded server (which imported torch once) instead of starting a fresh interpreter: ``python
tests/_torchrun.py ARGS...`` is torchrun. Its workers are started by torchrun as fresh interpreters, as ever."""

import runpy

if __name__ == "__main__":
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
