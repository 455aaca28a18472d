"""Tier 2 (launch): the examples run as the docs print them, and every code block of the docs is
an example's.

A page that drifts from the code is a broken promise to its first user. What is checked:

- every ```python block of README.md and docs/ is part of a file in examples/: the line before
  it ends by linking the file and a colon (``..., from [examples/train.py](...):``) and the
  block is that file's text, verbatim (whole, or a run of whole lines); so no block is untested
  and none hides a grouping;
- every example is printed as a command somewhere in those pages (``OMP_NUM_THREADS=1 torchrun
  --nproc-per-node 4 examples/train.py``, ``python examples/kl_loss.py``), and each command
  printed runs as printed (``bash -c``, from the checkout's root, this environment's
  ``torchrun`` and ``python`` first on ``PATH``, warnings not silenced by the test): exit 0, no
  abort at exit, at most 10 lines of output (one line per step from one rank, megatron-core's
  known CPU notices silenced by the example's one call of ``mopd.mcore.cpu.quiet``; checked
  before megatron-core 0.19, which logs GPTModel's deprecation on every rank), the result named
  once, in the last line of stdout; an example for a newer megatron-core says so in one line;
- the training examples are also checked for what their reader trusts, in one launch of their
  own functions (:mod:`tests.support.readme_checks`): the same batch at learning rate 0 twice
  hands the optimizer the same gradients; loss and gradients equal a float64 reference that
  counts exactly the rows predicting response tokens, for ``examples/train.py`` in fp32 and in
  bf16 (within bf16's tolerance, and against the fp32 job's gradients) and for
  ``examples/grpo.py`` (teachers on some ranks only, the policy-gradient term included);
- every relative link of the pages points at a file that exists.

Each example runs once (one launch per printed command, shared by the tests that read it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
#: the most lines an example prints (the issue's bound for the 4-rank training example)
MAX_LINES = 10
#: a command as the pages print it
_COMMAND = re.compile(
    r"(?:OMP_NUM_THREADS=1 torchrun --nproc-per-node \d+|python) examples/\w+\.py(?: --[\w-]+)*"
)
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
_FROM = re.compile(r"\[`?(examples/\w+\.py)`?\]\([^)]*\):$")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def _commands() -> tuple[str, ...]:
    """Every example command the pages print, once each, in page order."""
    found: list[str] = []
    for page in PAGES:
        found += [c for c in _COMMAND.findall(page.read_text()) if c not in found]
    return tuple(found)


def _megatron_core() -> tuple[int, int]:
    return tuple(map(int, re.findall(r"\d+", version("megatron-core"))[:2]))  # type: ignore[return-value]


def test_every_python_block_is_an_examples_text() -> None:
    blocks = 0
    for page in PAGES:
        text = page.read_text()
        for m in _BLOCK.finditer(text):
            blocks += 1
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            src = _FROM.search(before)
            assert src, (
                f"{_rel(page)}:{line}: a python block must follow a line ending in a link to its "
                f"example and a colon ('[examples/NAME.py](...):'), got {before!r}"
            )
            code = (ROOT / src[1]).read_text()
            block = m[1]
            assert block in code and (code.startswith(block) or f"\n{block}" in code), (
                f"{_rel(page)}:{line}: the block is not a run of whole lines of {src[1]}"
            )
    assert blocks >= 5


def test_every_example_is_printed_as_a_command() -> None:
    printed = {re.search(r"examples/\w+\.py", c)[0] for c in _commands()}  # type: ignore[index]
    assert printed == {_rel(p) for p in EXAMPLES}, "examples without a printed command, or gone"


def test_every_relative_link_resolves() -> None:
    for page in PAGES:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{_rel(page)} links to {target}, not there"


@cache
def _run(command: str) -> subprocess.CompletedProcess[str]:
    """``command`` as printed, by bash, from the checkout's root; this environment's torchrun
    and python first on PATH, no torchrun variables inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PYTHONWARNINGS",
    ):
        env.pop(name, None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("command", _commands())
def test_example_runs_as_printed(command: str) -> None:
    proc = _run(command)
    out = (proc.stdout + proc.stderr).rstrip("\n")
    lines = out.splitlines()
    name = re.search(r"examples/(\w+\.py)", command)[1]  # type: ignore[index]
    assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{out[-6000:]}"
    assert "terminate called" not in out, f"{command} aborted at exit:\n{out[-6000:]}"
    if name == "hybrid.py" and _megatron_core() < (0, 18):
        assert lines == [
            f"hybrid.py: HybridModel needs megatron-core 0.18 or newer; this is "
            f"{version('megatron-core')} (pip install 'megatron-core>=0.18')"
        ], out
        return
    if _megatron_core() < (0, 19):  # 0.19 logs GPTModel's deprecation on every rank
        assert len(lines) <= MAX_LINES, f"{command} printed {len(lines)} lines:\n{out[-6000:]}"
        assert not [x for x in lines if "Warning" in x], f"{command} warned:\n{out}"
    printed = proc.stdout.rstrip("\n").splitlines()
    assert printed and printed[-1].startswith(f"{name}: "), f"{command}: no result last:\n{out}"
    assert sum(x.startswith(f"{name}: ") for x in lines) == 1, out  # the result, once


def test_training_examples_print_one_line_per_step_from_one_rank() -> None:
    for command in _commands():
        if "examples/train.py" in command or "examples/grpo.py" in command:
            lines = _run(command).stdout.splitlines()
            steps = [x for x in lines if re.match(r"^step \d+/\d+: ", x)]
            total = int(re.match(r"^step \d+/(\d+)", steps[0])[1])  # type: ignore[index]
            assert [x.split(":")[0] for x in steps] == [
                f"step {s}/{total}" for s in range(1, total + 1)
            ]


def test_ray_worker_groups_learn_as_the_torchrun_worlds() -> None:
    """examples/ray_worlds.py runs examples/worlds.py's jobs in Ray actors: its steps' losses
    are the two torchrun jobs' (docs/ray.md says so), to every printed digit."""
    commands = _commands()
    assert "python examples/ray_worlds.py" in commands and "python examples/worlds.py" in commands

    def steps(command: str) -> list[str]:
        return [x for x in _run(command).stdout.splitlines() if re.match(r"^step \d+/\d+: ", x)]

    assert steps("python examples/ray_worlds.py") == steps("python examples/worlds.py") != []


def test_training_examples_are_right() -> None:
    """:mod:`tests.support.readme_checks`, one launch of 4 ranks: each check's line on every rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    proc = subprocess.run(
        [torchrun, "--nproc-per-node", "4", "-m", "tests.support.readme_checks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    for line in (
        "examples/train.py (fp32): same gradients over two steps",
        "examples/train.py (fp32): loss and gradients match the float64 reference",
        "examples/train.py (bf16): same gradients over two steps",
        "examples/train.py (bf16): gradients",
        "examples/train.py (bf16): loss and gradients match the float64 reference",
        "examples/grpo.py: loss and gradients match the float64 reference",
    ):
        assert out.count(line) == 4, (line, out[-4000:])
    for line in sorted({x for x in out.splitlines() if x.startswith("examples/")}):
        print(line)  # the figures the checks measured (pytest -s shows them)
