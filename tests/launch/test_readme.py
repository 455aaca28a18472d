"""Tier 2 (launch): every Python block of README.md runs as written, on CPU (gloo under torchrun).

A README that drifts from the code is a broken promise to its first user. Each ```python block
is announced by an HTML comment: ``<!-- readme-test: python -->`` (one process),
``<!-- readme-test: torchrun=N -->`` (N ranks), ``after=NAME`` (runs after the block marked
``prelude=NAME``, which is not run on its own). Blocks that share a prelude run in one launch, in
README order, each followed by a marker line the test checks, so a failure names its block. A
Python block without a comment fails the test.

The training loop is also checked for what its reader trusts, its gradients: after the blocks,
two steps with the same batch at learning rate 0, from a student without gradients as a fresh
one has, must hand the optimizer the same ``main_grad`` (a hand-off that leaves ``p.grad``
aliased to ``main_grad`` adds the first micro-batch twice from the second step on).
"""

from __future__ import annotations

import os
import re
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


@dataclass(frozen=True)
class Block:
    line: int
    code: str
    run: str  # "python", "torchrun", "prelude" or "" (unmarked)
    nproc: int
    after: str
    name: str


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
                code=m["code"],
                run=run,
                nproc=int(fields.get("torchrun") or 1),
                after=fields.get("after", ""),
                name=fields.get("prelude", ""),
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
#: ``train_step``, ``student`` and ``adam``).
TRAINING_LOOP_CHECK = """
for group in adam.param_groups:
    group["lr"] = 0.0
for p in student.parameters():
    p.grad = None  # as a fresh student has them
seen = []
hook = adam.register_step_pre_hook(
    lambda opt, args, kwargs: seen.append([p.grad.clone() for p in student.parameters()])
)
train_step(0)
train_step(0)
hook.remove()
worst = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(*seen))
assert worst < 1e-6, f"the same batch at lr=0 gave main_grads {worst:.3g} apart"
print("README training loop: same main_grad over two steps", flush=True)
"""


@pytest.mark.parametrize(("key", "group"), _groups(), ids=[k for k, _ in _groups()])
def test_readme_blocks_run(key: str, group: list[Block], tmp_path: Path) -> None:
    preludes = {b.name: b for b in _blocks() if b.run == "prelude"}
    nproc = max(b.nproc for b in group)
    parts = []
    if group[0].after:
        parts.append(preludes[group[0].after].code)
    for b in group:
        parts.append(b.code)
        parts.append(f'print("README block at line {b.line}: ok", flush=True)\n')
    check = any("def train_step" in b.code for b in group)
    if check:
        parts.append(TRAINING_LOOP_CHECK)
    script = tmp_path / "readme_example.py"
    script.write_text("\n".join(parts))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    if any(b.run == "torchrun" for b in group):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"README blocks of {key} failed (exit {proc.returncode}):\n{out[-6000:]}"
    )
    # a rank that exits without ending its process groups may abort in gloo's destructors
    # after printing its results (exit code still 0 now and then): the text gives it away
    assert "terminate called" not in out, f"README blocks of {key} aborted at exit:\n{out[-6000:]}"
    for b in group:
        assert out.count(f"README block at line {b.line}: ok") == nproc, out[-3000:]
    if check:
        assert out.count("README training loop: same main_grad over two steps") == nproc
