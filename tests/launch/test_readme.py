"""Tier 2 (launch): every Python block of README.md runs as written, on CPU (gloo under torchrun).

A README that drifts from the code is a broken promise to its first user. Each ```python block
is announced by an HTML comment: ``<!-- readme-test: python -->`` (one process),
``<!-- readme-test: torchrun=N -->`` (N ranks), ``after=NAME`` (runs after the block marked
``prelude=NAME``, which is not run on its own). Blocks that share a prelude run in one launch, in
README order, each followed by a marker line the test checks, so a failure names its block. A
Python block without a comment fails the test.

The training blocks are also checked for what their reader trusts (:mod:`tests.support.
readme_checks`): the same batch at learning rate 0 twice hands the optimizer the same gradients;
the GRPO block's loss and gradients equal a float64 reference that counts exactly the rows
predicting response tokens; and the same blocks under the README's one documented change for
mixed precision (``BF16 = True``) pass the same checks within bf16's tolerance, and against the
fp32 run's gradients.
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


def _launch(parts: list[str], group: list[Block], tmp_path: Path, env: dict) -> str:
    nproc = max(b.nproc for b in group)
    script = tmp_path / "readme_example.py"
    script.write_text("\n".join(parts))
    if any(b.run == "torchrun" for b in group):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README blocks failed (exit {proc.returncode}):\n{out[-6000:]}"
    # a rank that exits without ending its process groups may abort in gloo's destructors
    # after printing its results (exit code still 0 now and then): the text gives it away
    assert "terminate called" not in out, f"README blocks aborted at exit:\n{out[-6000:]}"
    for b in group:
        assert out.count(f"README block at line {b.line}: ok") == nproc, out[-3000:]
    for line in sorted({x for x in out.splitlines() if x.startswith("README GRPO")}):
        print(line)  # the figures the checks measured (pytest -s shows them)
    return out


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
        parts.append(TRAINING_CHECK)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["MOPD_README_GRADS"] = str(tmp_path)
    out = _launch(parts, group, tmp_path, env)
    if not check:
        return
    assert out.count("README training loop: same gradients over two steps") == nproc
    assert out.count("README GRPO block (fp32): loss and gradients match") == nproc, out[-3000:]
    # the one documented change for mixed precision: the same blocks, the same checks, in bf16
    assert parts[0].count(FP32_LINE) == 1, "the prelude's precision switch moved"
    parts[0] = parts[0].replace(FP32_LINE, "BF16 = True")
    out = _launch(parts, group, tmp_path, env)
    assert out.count("README GRPO block (bf16): loss and gradients match") == nproc, out[-3000:]
    assert out.count("README GRPO block in bf16: gradients") == nproc, out[-3000:]
