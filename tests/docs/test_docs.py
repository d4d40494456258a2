"""Every Python example and shell command of README.md and the site's pages (docs/**/*.md) runs exactly as
written, and so does every shell command of examples/README.md, unless the block is marked an illustration
(``<!-- illustration: why -->`` on the line before it). An example or command that appears on two pages runs
once."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _recipe
import pytest
from _paths import pythonpath_first

pytestmark = pytest.mark.heavy  # run first (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
# README.md first: its first command is the run started from a fresh interpreter
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)]
MARKER = re.compile(r"<!-- illustration: (.+?) -->\n$")


def _blocks(path: Path, language: str) -> list[tuple[str | None, str]]:
    """Each fenced block of ``language`` in ``path``: (why it is an illustration, or None; its text)."""
    text = path.read_text()
    blocks = []
    for match in re.finditer(rf"```{language}\n(.*?)```", text, re.S):
        marker = MARKER.search(text[: match.start()])
        blocks.append((marker.group(1) if marker else None, match.group(1)))
    return blocks


def _python_examples() -> list[str]:
    """The Python examples of the pages that run, each once (in the order the pages show them)."""
    examples = []
    for path in PAGES:
        for why, code in _blocks(path, "python"):
            assert why is None or why.strip(), f"{path.name}: an illustration says why"
            if why is None and code not in examples:
                examples.append(code)
    return examples


def _example(marker: str) -> str:
    """The one Python example that contains ``marker``."""
    (code,) = [code for code in _python_examples() if marker in code]
    return code


def test_the_readmes_links_lead_to_files_of_the_repository():
    """README.md is read on GitHub, outside the site whose build checks its own links."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10, links
    assert not [link for link in links if not (ROOT / link).is_file()]


# The examples whose output the tests below check; every other one must run and exit 0.
ONE_PROCESS, TWO_PROCESSES, CALLBACKS = "# pure: `state` is unchanged", "fdp.spawn(worker", "class LossLog(Callback)"


def _env() -> dict:
    """This checkout first on the path, the caller's own entries (site dirs) kept."""
    return {**os.environ, "PYTHONPATH": pythonpath_first(ROOT)}


def _run(code: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """``python example.py`` in ``cwd``, forked from the preloaded server (tests/_recipe.py); its ``fdp.spawn``
    starts its workers from a forkserver of its own that imported torch and fdp once: the worker function must
    pickle and the script re-imports as ``__mp_main__``, as a spawned worker's must."""
    (cwd / "example.py").write_text(code)
    return _recipe.run([sys.executable, "example.py"], env=_env(), cwd=cwd, timeout=timeout, workers="forkserver")


def test_the_one_process_example_runs(tmp_path):
    code = _example(ONE_PROCESS)
    done = _run(code + "\nassert state.step == 1 and metrics['loss'] > 0\n", tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_two_process_example_trains_checkpoints_and_resumes_to_the_same_params(tmp_path):
    done = _run(_example(TWO_PROCESSES), tmp_path, timeout=500)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "6 steps straight and 3 + 3 resumed: the same parameters on both ranks"
    assert [line.split(":")[0] for line in lines[:-1]] == ["step 3", "step 6", "step 6"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "last",
        "step_00000003.pt",
        "step_00000006.pt",
    ]


def test_the_callbacks_example_runs_and_its_callback_writes_every_fifth_step(tmp_path):
    done = _run(_example(CALLBACKS), tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "4 lines"
    lines = (tmp_path / "outputs" / "callbacks" / "losses.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [5, 10, 15, 20]


def test_every_other_python_example_runs(tmp_path):
    """The examples no test above reads (a notebook's forked workers, ...): each exits 0 as written."""
    others = [
        code for code in _python_examples() if not any(m in code for m in (ONE_PROCESS, TWO_PROCESSES, CALLBACKS))
    ]
    assert others, "the pages have examples besides the three checked above"
    failures = []
    for n, code in enumerate(others):
        cwd = tmp_path / f"example{n}"
        cwd.mkdir()
        done = _run(code, cwd, timeout=300)
        if done.returncode != 0:
            failures.append(f"{code.splitlines()[0]} ...\n  -> exit {done.returncode}: {done.stderr[-1500:]}")
    assert not failures, "\n".join(failures)


# -- every shell command of the pages and examples/README.md --------------------------------------
# The pages' runs capped (a later override wins; examples/README.md's run as written): MAX_STEPS steps, or the
# largest step count the command sets in PERIODS, so that each evaluates, compresses, warms up or syncs once as
# written; EVAL_BATCHES batches per evaluation. A command only has to run: nothing reads how far it trained.
MAX_STEPS = 4
PERIODS = (
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "hooks.start_iter",
    "optim.warmup_steps",
    "outer.sync_every",
)
EVAL_BATCHES = 2


def _commands(block: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", block)
    return [
        line.split("  #")[0].strip()
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _runnable(command: str, tmp: Path, dirs: dict, cap: bool) -> tuple[list[str], dict]:
    """``command`` as argv and environment, its run directory (or sweep) moved under ``tmp``."""
    words = shlex.split(command)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_first(ROOT)}
    while "=" in words[0]:
        name, _, value = words.pop(0).partition("=")
        env[name] = pythonpath_first(ROOT / value, ROOT) if name == "PYTHONPATH" else value
    assert words[0] == "python", command
    argv = [sys.executable, *words[1:]]
    for i, word in enumerate(argv):
        if word.startswith("hydra.run.dir="):
            argv[i] = "hydra.run.dir=" + str(dirs.setdefault(word, tmp / f"run{len(dirs)}"))
    if not any(w.startswith("hydra.run.dir=") for w in argv):
        argv.append(f"hydra.run.dir={tmp / f'run{len(dirs)}'}")
        dirs[f"unnamed{len(dirs)}"] = None
    if "-m" in argv:
        argv.append(f"hydra.sweep.dir={tmp / f'sweep{len(dirs)}'}")
    if cap and argv[1].endswith("train.py"):
        argv += _capped(argv)
    return [*argv, "trainer.progress=false"] if argv[1].endswith("train.py") else argv, env


def _capped(argv: list[str]) -> list[str]:
    """The overrides that cap a page's run of ``argv``: its steps and evaluation batches."""
    settings = dict(w.split("=", 1) for w in argv[2:] if "=" in w and not w.startswith(("+", "~")))
    steps = max([MAX_STEPS, *(int(settings[key]) for key in PERIODS if key in settings)])
    out = [] if int(settings.get("trainer.max_steps", steps + 1)) <= steps else [f"trainer.max_steps={steps}"]
    return out + ([] if "trainer.eval_batches" in settings else [f"trainer.eval_batches={EVAL_BATCHES}"])


def test_a_pages_run_is_capped_but_reaches_the_periods_it_sets():
    capped = _capped(["python", "train.py", "trainer.eval_every=8", "outer.sync_every=16", "trainer.max_steps=32"])
    assert capped == ["trainer.max_steps=16", f"trainer.eval_batches={EVAL_BATCHES}"]
    assert _capped(["python", "train.py", "hooks.start_iter=2"]) == [
        f"trainer.max_steps={MAX_STEPS}",
        f"trainer.eval_batches={EVAL_BATCHES}",
    ]
    assert _capped(["python", "train.py", "trainer.max_steps=3", "trainer.eval_batches=1"]) == []


def _run_chain(chain: list, fresh: bool) -> list[str]:
    """``fresh``: each command from a fresh interpreter, as the shell starts it; otherwise forked from the
    preloaded server (tests/_recipe.py), which saves each command the 5 s of importing torch again."""
    failures = []
    for argv, env, command in chain:
        done = _recipe.run(argv, env=env, cwd=ROOT, timeout=600, fresh=fresh)
        if done.returncode != 0:
            failures.append(f"{command}\n  -> exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return failures


def test_every_shell_command_of_the_pages_runs_or_is_marked_an_illustration(tmp_path):
    """Each command of a ```bash block runs from the repository root and exits 0; a block it
    cannot run here (GPUs, clusters, installs) says so in an HTML comment before it. The pages' runs are
    capped (``_capped``). Commands that share a run directory (a run stopped, then resumed) run in order;
    the others two at a time, and a command that stands alone on two pages (README's first run, also on the
    shell page) once. The first runs from a fresh interpreter, the others forked from one that imported torch
    and fdp already (tests/_recipe.py): as the shell runs them but for the imports, most of a short run's time."""
    chains: dict[str, list] = {}
    alone: set[tuple[str, bool]] = set()
    sources = [(path, True) for path in PAGES] + [(ROOT / "examples" / "README.md", False)]
    for path, cap in sources:
        for n, (why, block) in enumerate(_blocks(path, "bash")):
            if why is not None:
                assert why.strip(), f"{path.name}: an illustration says why"
                continue
            tmp, dirs = tmp_path / f"{path.relative_to(ROOT).with_suffix('')}{n}".replace("/", "_"), {}
            tmp.mkdir()
            for command in _commands(block):
                if "hydra.run.dir=" not in command:
                    if (command, cap) in alone:
                        continue
                    alone.add((command, cap))
                argv, env = _runnable(command, tmp, dirs, cap)
                chains.setdefault(next(w for w in argv if w.startswith("hydra.run.dir=")), []).append(
                    (argv, env, command)
                )
    assert sum(map(len, chains.values())) >= 10
    first = next(iter(chains.values()))  # README's bare `python recipes/train.py`: from a fresh interpreter
    assert first[0][2] == "python recipes/train.py", first[0][2]
    # The longest first (local worlds start workers, char models step slowly), so that no long one runs alone
    # at the end while the other thread has nothing left.
    weight = {"world=local2": 2, "model=charlm": 4}  # a char model's step is ten of the MLP's
    order = sorted(
        chains.values(), key=lambda chain: -sum(1 + sum(w for k, w in weight.items() if k in c) for *_, c in chain)
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        found = pool.map(_run_chain, order, [chain is first for chain in order])
        failures = [f for each in found for f in each]
    assert not failures, "\n".join(failures)
