"""Tier 1: the KL benchmark's harness runs on CPU (``--quick``) and records what it measured.

Not a timed test: it checks that every peer runs, that their losses agree with ours (the same
reverse KL, so ``loss_rel_diff`` is small), and that ``--results-dir`` gets the CSV and Markdown.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mopd.profiling import bench_kl


def test_quick_run_records_rows_that_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench_kl.main(["--quick", "--tokens", "40", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipping Liger-Kernel" in out or "Liger-Kernel JSD" in out
    csvs = list(tmp_path.glob("kl-*.csv"))
    assert len(csvs) == 1 and len(list(tmp_path.glob("kl-*.md"))) == 1
    rows = list(csv.DictReader(csvs[0].open()))
    methods = {r["method"] for r in rows}
    assert {"naive torch", "torch chunked 1024"} <= methods
    assert any(m.startswith("ours") for m in methods)
    for r in rows:
        assert float(r["fwd_bwd_ms"]) > 0
        assert float(r["loss_rel_diff"]) < 1e-4, r


def test_peers_compute_the_same_gradients() -> None:
    x = bench_kl.make_inputs(50, 8, 70, torch.float64, torch.device("cpu"))
    grads = []
    for fn in (bench_kl.naive_torch, lambda x: bench_kl.chunked_torch(x, chunk=16)):
        for t in x[:2]:
            t.grad = None
        fn(x)
        grads.append([t.grad.clone() for t in x[:2]])
    for t in x[:2]:
        t.grad = None
    bench_kl.ours(x, bench_kl.KLConfig(chunk_tokens=7))
    grads.append([t.grad.clone() for t in x[:2]])
    for g in grads[1:]:
        for a, b in zip(g, grads[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_measured_run_refuses_a_cpu_only_machine() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the measured run is allowed")
    with pytest.raises(SystemExit):
        bench_kl.main([])
