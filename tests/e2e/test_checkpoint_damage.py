"""A damaged checkpoint of either format is refused before the run touches its directory (fdp.run.checkpoint.integrity).

One trained run per format (module fixtures: a whole-file run in one process, a sharded one of two
ranks at ZeRO stage 3), copied for each case; each case damages the copy one way and resumes it with
``trainer.resume=true``: one line naming the damaged file, exit 2, and every file of the run as it was
(no ``.hydra/resume-1``, no line appended to ``train.log``). ``python -m fdp.checkpoint consolidate``
refuses the same way, writing nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import zipfile
from pathlib import Path

import _recipe
import pytest
import torch

from fdp import checkpoint as command
from fdp.run import checkpoint
from fdp.run.checkpoint.integrity import MANIFEST

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.hidden=16", "data.global_batch_size=16", "trainer.eval_every=0", "trainer.progress=false"]
FORMATS = {
    "whole": ["trainer.checkpoint_every=2"],
    "sharded": [
        "world=local2",
        "world.backend=gloo",
        "world.timeout_s=60",
        "trainer.zero_stage=3",
        "trainer.checkpoint_format=sharded",
        "trainer.checkpoint_every=2",
    ],
}


def recipe(run_dir, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, str(ROOT / "recipes" / "train.py"), *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    return _recipe.run(argv, env=env, cwd=ROOT, timeout=180)


def snapshot(directory: Path) -> dict:
    """Every path under ``directory``: a file's SHA-256 and modification time, a folder's ``None``."""
    return {
        str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        if p.is_file()
        else None
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{format: run directory}``, each trained 4 steps (checkpoints at steps 2 and 4), made at first use."""
    made = {}

    def run_of(kind: str) -> Path:
        if kind not in made:
            run_dir = tmp_path_factory.mktemp(kind) / "run"
            done = recipe(run_dir, *FORMATS[kind], "trainer.max_steps=4")
            assert done.returncode == 0, done.stderr[-3000:]
            made[kind] = run_dir
        return made[kind]

    return run_of


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path) -> None:
    """One byte in the middle of the largest tensor changed: the file's size and structure are as they were."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    if path.suffix == ".pt":  # in the zip archive: past the largest record's local header
        with zipfile.ZipFile(path) as archive:
            record = max(archive.infolist(), key=lambda info: info.file_size)
        header = record.header_offset
        name_length, extra_length = struct.unpack("<HH", data[header + 26 : header + 30])
        at = header + 30 + name_length + extra_length + record.file_size // 2
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    torch.save([1, 2, 3], path)


def _scribble(path: Path) -> None:
    path.write_text("a note of the user's\n")


def _without_opt_state(path: Path) -> None:
    payload = torch.load(path, weights_only=True)
    del payload["opt_state"]
    torch.save(payload, path)


# (format, the damaged file in the newest checkpoint (or the checkpoints' last), what is done to it, words of the
# refusal)
DAMAGE = [
    ("whole", "", _cut, "truncated"),
    ("whole", "", Path.unlink, "expected a checkpoint at"),
    ("whole", "", _flip, "fails its checksum"),
    ("whole", "", _foreign, "not an fdp checkpoint"),
    ("whole", "", _without_opt_state, "no 'opt_state' entry"),
    ("whole", "last", _scribble, "unreadable"),
    ("sharded", "__1_0.distcp", _cut, "truncated"),
    ("sharded", "__1_0.distcp", Path.unlink, "missing"),
    ("sharded", "__0_0.distcp", _flip, "damaged"),
    ("sharded", "rank1.pt", Path.unlink, "missing"),
    ("sharded", "rank1.pt", _cut, "truncated"),
    ("sharded", ".metadata", Path.unlink, "missing"),
    ("sharded", ".metadata", _cut, "truncated"),
    ("sharded", "fdp.pt", Path.unlink, "missing"),
    ("sharded", "fdp.pt", _foreign, "damaged"),
    ("sharded", "manifest.json", _cut, "unreadable"),
    ("sharded", "last", _scribble, "unreadable"),
]


@pytest.mark.parametrize(
    "kind, name, damage, words",
    DAMAGE,
    ids=[f"{kind}-{name or 'step file'}-{damage.__name__.strip('_')}" for kind, name, damage, _ in DAMAGE],
)
def test_a_damaged_checkpoint_is_refused_in_one_line_and_the_run_is_left_as_it_was(
    trained, tmp_path, kind, name, damage, words
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained(kind), run_dir)
    newest = checkpoint.last_of(run_dir / "checkpoints")
    damaged = run_dir / "checkpoints" / "last" if name == "last" else newest / name if name else newest
    damage(damaged)
    before = snapshot(run_dir)
    refused = recipe(run_dir, *FORMATS[kind], "trainer.resume=true", "trainer.max_steps=6")
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert lines[0].startswith("error: ") and f"{damaged} " in lines[0] and words in lines[0], lines[0]
    assert snapshot(run_dir) == before  # no .hydra/resume-1, no log line, nothing rewritten


@pytest.mark.parametrize("kind", FORMATS)
def test_a_checkpoint_of_another_model_is_refused_once_built_and_the_run_is_left_as_it_was(trained, tmp_path, kind):
    run_dir = tmp_path / "run"
    shutil.copytree(trained(kind), run_dir)
    before = snapshot(run_dir)
    refused = recipe(run_dir, *FORMATS[kind], "trainer.resume=true", "trainer.max_steps=6", "model.hidden=32")
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    newest = checkpoint.last_of(run_dir / "checkpoints")
    assert lines[0].startswith(f"error: checkpoint {newest}") and "another bucket plan" in lines[0], lines[0]
    assert snapshot(run_dir) == before


def test_a_sharded_checkpoint_records_every_file_it_holds(trained):
    newest = checkpoint.last_of(trained("sharded") / "checkpoints")
    recorded = set(json.loads((newest / MANIFEST).read_text())["files"])
    assert recorded == {p.name for p in newest.iterdir()} - {MANIFEST}
    assert {"fdp.pt", ".metadata", "rank0.pt", "rank1.pt", "__0_0.distcp", "__1_0.distcp"} <= recorded


def _consolidate(capsys, *argv) -> tuple[int, list[str]]:
    status = command.main(["consolidate", *map(str, argv)])
    captured = capsys.readouterr()
    return status, [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def test_consolidate_refuses_in_one_line_and_writes_nothing(trained, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained("sharded"), run_dir)
    newest = checkpoint.last_of(run_dir / "checkpoints")
    (tmp_path / "there.pt").write_bytes(b"a file of the user's")
    (tmp_path / "a_file").write_text("not a directory")
    cases = [
        (tmp_path / "there.pt", "it exists"),
        (tmp_path / "model.bin", "expected a file ending in .pt or .safetensors"),
        (tmp_path / "nowhere" / "model.pt", "does not exist"),
        (tmp_path / "a_file" / "model.pt", "does not exist"),
    ]
    before = {"run": snapshot(run_dir), "out": snapshot(tmp_path)}
    for to, words in cases:
        status, lines = _consolidate(capsys, run_dir, "--to", to)
        assert status == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"fdp.checkpoint: cannot write {to}") and words in lines[0], lines
    assert {"run": snapshot(run_dir), "out": snapshot(tmp_path)} == before
    _cut(newest / "__1_0.distcp")
    before = {"run": snapshot(run_dir), "out": snapshot(tmp_path)}
    status, lines = _consolidate(capsys, run_dir, "--to", tmp_path / "model.safetensors")
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"fdp.checkpoint: checkpoint {newest / '__1_0.distcp'} is damaged"), lines
    assert {"run": snapshot(run_dir), "out": snapshot(tmp_path)} == before
