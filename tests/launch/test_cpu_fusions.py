"""Tier 2 (launch): ``mopd.mcore.cpu.apply()`` makes megatron-core's fusions plain eager functions.

What a user of CPU ranks relies on: called before megatron-core is imported (as the examples do),
the import loads neither TorchDynamo nor Inductor (seconds of start-up on every rank), a fusion is
the function megatron wrote (no C++ build at its first call), ``torch.compile`` is torch's own
again afterwards, and a fusion's answer is unchanged. Called after the import, the fusions
megatron defines from then on are plain. Each case runs in a fresh interpreter: this process
may have imported megatron-core already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]

BEFORE = """
import json, sys, torch
compile_ = torch.compile
from mopd.mcore import cpu
cpu.apply()
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu
y = torch.linspace(-3, 3, 11, dtype=torch.float64)
b = torch.full((11,), 0.25, dtype=torch.float64)
ref = (y + b) * 0.5 * (1.0 + torch.tanh(0.79788456 * (y + b) * (1 + 0.044715 * (y + b) ** 2)))
print(json.dumps({
    "dynamo": "torch._dynamo" in sys.modules,
    "inductor": "torch._inductor" in sys.modules,
    "plain": fused_bias_gelu.bias_gelu.__code__.co_filename == fused_bias_gelu.__file__,
    "jit_fuser": jit.jit_fuser is jit.noop_decorator,
    "compile_restored": torch.compile is compile_,
    "equal": torch.equal(fused_bias_gelu.bias_gelu(b, y), ref),
}))
"""

AFTER = """
import json, torch
import megatron.core
from mopd.mcore import cpu
cpu.apply()
from megatron.core import jit
print(json.dumps({"jit_fuser": jit.jit_fuser is jit.noop_decorator}))
"""


def _run(code: str) -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_applied_before_the_import_no_dynamo_no_inductor_and_plain_fusions() -> None:
    got = _run(BEFORE)
    assert got == {
        "dynamo": False,
        "inductor": False,
        "plain": True,
        "jit_fuser": True,
        "compile_restored": True,
        "equal": True,
    }, got


def test_applied_after_the_import_later_fusions_are_plain() -> None:
    assert _run(AFTER) == {"jit_fuser": True}
