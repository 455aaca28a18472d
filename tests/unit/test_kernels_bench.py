"""Tier 1: the kernel benchmark's harness runs on CPU (``--quick``) and survives a broken kernel.

The figures of a quick CPU run mean nothing; what is checked is that every peer and every
kernel row is produced, outputs are checked bit for bit, results are recorded where asked, and
a kernel that raises becomes an ERROR row instead of losing the peers' figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd.profiling import bench_kernels


def test_quick_run_records_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_kernels.main(["--quick", "--gib", "0.001", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for peer in ("tensor.copy_", "torch.index_select", "torch.index_copy_", "copy_(transpose)"):
        assert peer in out
    csv_files = list(tmp_path.glob("kernels-*.csv"))
    assert len(csv_files) == 1
    text = csv_files[0].read_text()
    for op in ("gather", "scatter", "copy_runs", "views at element 1"):
        assert op in text
    assert "False" not in text  # every bit_exact check held
    assert "QUICK CPU RUN" in next(tmp_path.glob("kernels-*.md")).read_text()


def test_broken_kernel_becomes_error_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("planted failure")

    monkeypatch.setattr(bench_kernels, "gather_rows", broken)
    assert bench_kernels.main(["--quick", "--gib", "0.001", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "| ERROR |" in out and "planted failure" in out
    assert "torch.index_select" in out  # the peers' figures survive


def test_measured_run_rejects_small_settings() -> None:
    with pytest.raises(ValueError, match="--iters >= 20 and --gib >= 1"):
        bench_kernels.main(["--iters", "5"])
