"""``python -m fdp.checkpoint consolidate RUN_DIR [--to model.safetensors]``: a sharded checkpoint as one file.

``RUN_DIR`` is a run directory, its ``checkpoints/`` or one ``step_<N>/`` checkpoint (a run's
is its last). ``--to`` names the file: ``.pt`` (the default, ``<checkpoint>.pt`` beside it) is
a whole-file checkpoint that any stage and world size resumes (``trainer.resume=PATH``) and
``torch.load(..., weights_only=True)`` reads; ``.safetensors`` holds the params alone, by
parameter name (for a model built with ``fdp.hf_model``, the Hugging Face model's own names).
The work is ``fdp.run.checkpoint.consolidate``'s.

>>> main(["consolidate", "/nonexistent"])
fdp.checkpoint: checkpoint /nonexistent does not exist
2
"""

from __future__ import annotations

import argparse
import sys

from fdp.run.checkpoint import CheckpointError, write_consolidated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fdp.checkpoint", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("consolidate", help="write a sharded checkpoint as one .pt or .safetensors file")
    one.add_argument("run_dir", help="a run directory, its checkpoints/ or a step_<N>/ checkpoint")
    one.add_argument("--to", default=None, help="the file to write (.pt or .safetensors)")
    args = parser.parse_args(argv)
    try:
        written = write_consolidated(args.run_dir, args.to)
    except CheckpointError as error:
        print(f"fdp.checkpoint: {error}", file=sys.stdout)
        return 2
    print(f"fdp.checkpoint: wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
