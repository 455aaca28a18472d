"""Tier 2 (launch): every Python block of README.md runs as written, on CPU (gloo under torchrun),
with the command the README prints for it.

A README that drifts from the code is a broken promise to its first user. Each ```python block
is announced by an HTML comment: ``<!-- readme-test: python -->`` (one process, ``python
example.py``), ``<!-- readme-test: torchrun=N -->`` (N ranks), ``after=NAME`` (runs after the
block marked ``prelude=NAME``, which is not run on its own), ``requires=MODULE`` (left out, with
the reason, where MODULE cannot be found: a block for a newer megatron-core). Blocks that share a
prelude run in one launch, in README order, each followed by a marker line the test checks, so a
failure names its block. A Python block without a comment fails the test. A multi-rank launch
runs the command the README prints before it (``torchrun --nproc-per-node N example.py``, N the
block's ranks) from the folder holding ``example.py``, in the environment as it is (torchrun
then picks a free port itself), warnings not silenced.

The training blocks are also checked for what their reader trusts (:mod:`tests.support.
readme_checks`): the same batch at learning rate 0 twice hands the optimizer the same gradients;
the GRPO block's loss and gradients equal a float64 reference that counts exactly the rows
predicting response tokens; and the same blocks under the README's one documented change for
mixed precision (``BF16 = True``) pass the same checks within bf16's tolerance, and against the
fp32 run's gradients.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
_BLOCK = re.compile(
    r"(?:<!--\s*readme-test:(?P<spec>[^>]*)-->\s*\n)?```python\n(?P<code>.*?)```", re.S
)
#: a multi-rank command as the README prints it, in backticks
_COMMAND = re.compile(r"`(torchrun --nproc-per-node (\d+) (\w+\.py))`")


@dataclass(frozen=True)
class Block:
    line: int
    start: int  # character offset of the block (its marker) in the README
    code: str
    run: str  # "python", "torchrun", "prelude" or "" (unmarked)
    nproc: int
    after: str
    name: str
    requires: str  # a module the block needs ("" for none)


def _blocks() -> list[Block]:
    text = README.read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        fields = dict(f.split("=", 1) if "=" in f else (f, "") for f in (m["spec"] or "").split())
        if "prelude" in fields:
            run = "prelude"
        elif "torchrun" in fields:
            run = "torchrun"
        elif "python" in fields:
            run = "python"
        else:
            run = ""
        out.append(
            Block(
                line=line,
                start=m.start(),
                code=m["code"],
                run=run,
                nproc=int(fields.get("torchrun") or 1),
                after=fields.get("after", ""),
                name=fields.get("prelude", ""),
                requires=fields.get("requires", ""),
            )
        )
    return out


def test_every_python_block_is_marked() -> None:
    blocks = _blocks()
    assert len(blocks) >= 4
    unmarked = [b.line for b in blocks if not b.run]
    assert not unmarked, f"README python blocks without a readme-test comment at lines {unmarked}"
    preludes = {b.name for b in blocks if b.run == "prelude"}
    assert {b.after for b in blocks if b.after} <= preludes


def test_every_multi_rank_example_ends_its_process_groups() -> None:
    """A multi-rank example that leaves its process groups to the interpreter's exit aborts now
    and then in the destructors ("terminate called without an active exception"), after every
    rank printed its result: each launch's code ends them itself."""
    for key, group in _groups():
        if any(b.run == "torchrun" for b in group):
            code = "".join(b.code for b in group)
            if group[0].after:
                code = _prelude(group[0].after).code + code
            assert "dist.destroy_process_group" in code, f"README blocks of {key} never end it"


def _prelude(name: str) -> Block:
    return next(b for b in _blocks() if b.run == "prelude" and b.name == name)


def _groups() -> list[tuple[str, list[Block]]]:
    """Launches: blocks sharing a prelude together; the others each alone."""
    blocks = _blocks()
    runs = [b for b in blocks if b.run in ("python", "torchrun")]
    groups: dict[str, list[Block]] = {}
    for b in runs:
        groups.setdefault(b.after or f"line {b.line}", []).append(b)
    return sorted(groups.items())


#: Appended to the launch of the blocks after the ``megatron-models`` prelude (they define
#: ``train_step``, the models, ``adam`` and its ``master`` weights, ``rollouts`` and
#: ``grpo_forward_step``): the checks of :mod:`tests.support.readme_checks`.
TRAINING_CHECK = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests.support.readme_checks import check_training_blocks
check_training_blocks(globals())
"""
#: The README's one documented change for mixed precision.
FP32_LINE = "BF16 = False"


def _launch(parts: list[str], group: list[Block], left_out: list[Block], tmp_path: Path) -> str:
    """Run ``parts`` as the README prints it (``torchrun --nproc-per-node N example.py``, or
    ``python example.py``) in ``tmp_path``; the output, once the blocks' markers are checked."""
    nproc = max(b.nproc for b in group)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env.pop("PYTHONWARNINGS", None)
    env["OMP_NUM_THREADS"] = "1"  # a shared machine; the README's command is unchanged
    env["MOPD_README_GRADS"] = str(tmp_path)  # the fp32 run's gradients, for the bf16 run
    if any(b.run == "torchrun" for b in group):
        cmd, ranks, name = _printed_command(group[0])
        assert ranks == nproc, f"the README prints {ranks} ranks for blocks that need {nproc}"
        cmd[0] = str(Path(sys.executable).parent / cmd[0])  # this environment's torchrun
    else:
        cmd, name = [sys.executable, "example.py"], "example.py"
    (tmp_path / name).write_text("\n".join(parts))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README blocks failed (exit {proc.returncode}):\n{out[-6000:]}"
    # a rank that exits without ending its process groups may abort in gloo's destructors
    # after printing its results (exit code still 0 now and then): the text gives it away
    assert "terminate called" not in out, f"README blocks aborted at exit:\n{out[-6000:]}"
    for b in group:
        assert out.count(f"README block at line {b.line}: ok") == nproc, out[-3000:]
    for b in left_out:
        assert f"README block at line {b.line}: ok" not in out
    for line in sorted({x for x in out.splitlines() if x.startswith("README GRPO")}):
        print(line)  # the figures the checks measured (pytest -s shows them)
    return out


def _printed_command(block: Block) -> tuple[list[str], int, str]:
    """``(argv, ranks, script name)`` of the last multi-rank command the README prints before
    ``block`` (its prelude's, for a block that runs after one)."""
    if block.after:
        block = _prelude(block.after)
    text = README.read_text()
    found = [m for m in _COMMAND.finditer(text) if m.start() < block.start]
    assert found, (
        f"README prints no `torchrun --nproc-per-node N example.py` before line {block.line}"
    )
    m = found[-1]
    return shlex.split(m[1]), int(m[2]), m[3]


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def test_every_launch_has_its_command_printed() -> None:
    for key, group in _groups():
        if any(b.run == "torchrun" for b in group):
            _, ranks, _ = _printed_command(group[0])
            assert ranks == max(b.nproc for b in group), f"README blocks of {key}"


@pytest.mark.parametrize(("key", "group"), _groups(), ids=[k for k, _ in _groups()])
def test_readme_blocks_run(key: str, group: list[Block], tmp_path: Path) -> None:
    preludes = {b.name: b for b in _blocks() if b.run == "prelude"}
    left_out = [b for b in group if b.requires and _missing(b.requires)]
    group = [b for b in group if b not in left_out]
    if not group:
        pytest.skip(f"needs {left_out[0].requires}, which this environment does not have")
    nproc = max(b.nproc for b in group)
    parts = []
    if group[0].after:
        parts.append(preludes[group[0].after].code)
    for b in group:
        parts.append(b.code)
        parts.append(f'print("README block at line {b.line}: ok", flush=True)\n')
    check = any("def train_step" in b.code for b in group)
    if check:
        parts.append(TRAINING_CHECK)
    out = _launch(parts, group, left_out, tmp_path)
    if not check:
        return
    assert out.count("README training loop: same gradients over two steps") == nproc
    assert out.count("README GRPO block (fp32): loss and gradients match") == nproc, out[-3000:]
    # the one documented change for mixed precision: the same blocks, the same checks, in bf16
    assert parts[0].count(FP32_LINE) == 1, "the prelude's precision switch moved"
    parts[0] = parts[0].replace(FP32_LINE, "BF16 = True")
    out = _launch(parts, group, left_out, tmp_path)
    assert out.count("README GRPO block (bf16): loss and gradients match") == nproc, out[-3000:]
    assert out.count("README GRPO block in bf16: gradients") == nproc, out[-3000:]
