"""Tier 1: the kernel benchmark's harness runs on CPU (``--quick``) and survives a broken kernel.

The figures of a quick CPU run mean nothing; what is checked is that every peer and every
kernel row is produced, outputs are checked bit for bit, results are recorded where asked, a
kernel that raises becomes an ERROR row instead of losing the peers' figures, a run cut short
keeps its rows, the table is printed once and labelled functional, and progress goes to stderr
on a terminal only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd.profiling.bench import kernels as bench_kernels


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
    md = next(tmp_path.glob("kernels-*.md")).read_text()
    assert "QUICK CPU RUN" in md and "functional figures" in md
    assert out.count("| op |") == 1 and "% of copy" not in out  # one table, no per-row lines
    assert out.startswith("CPU run: functional figures")


def test_progress_names_each_case_on_stderr_of_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert bench_kernels.main(["--quick", "--gib", "0.001", "--no-record"]) == 0
    captured = capsys.readouterr()
    assert "kernels" in captured.err and "gather | random | twin (torch)" in captured.err
    assert "twin (torch):" not in captured.out  # stdout keeps only the table and summary
    assert bench_kernels.main(["--quick", "--gib", "0.001", "--no-record", "--no-progress"]) == 0
    assert "gather | random" not in capsys.readouterr().err


def test_a_run_cut_short_keeps_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # what SIGTERM from a time limit becomes

    monkeypatch.setattr(bench_kernels, "copy_runs", interrupted)
    rc = bench_kernels.main(["--quick", "--gib", "0.001", "--results-dir", str(tmp_path)])
    assert rc == 130
    out = capsys.readouterr().out
    assert "CUT SHORT after" in out and "torch.index_select" in out
    (csv_path,) = tmp_path.glob("kernels-*.csv")
    text = csv_path.read_text()
    assert "gather" in text and "scatter" in text and "copy_runs" not in text
    assert "CUT SHORT" in csv_path.with_suffix(".md").read_text()


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
    with pytest.raises(ValueError, match="--iters >= 15 and --gib >= 1"):
        bench_kernels.main(["--iters", "5"])


def _row(op: str, indices: str, impl: str, pct: float, exact: object = True) -> dict[str, object]:
    return {"op": op, "indices": indices, "impl": impl, "%_of_copy": pct, "bit_exact": exact}


def test_summary_names_the_best_variant_per_op() -> None:
    rows = [
        _row("copy (ceiling)", "-", "tensor.copy_", 100.0, ""),
        _row("gather", "random", "torch.index_select", 99.0, ""),  # peers never win
        _row("gather", "random", "cupy:a", 94.0),
        _row("gather", "runs", "cupy:a", 90.0),  # mean 92
        _row("gather", "random", "cupy:b", 91.0),
        _row("gather", "runs", "cupy:b", 95.0),  # mean 93: b wins gather
        _row("gather", "random", "cupy:c", 99.0),  # c lacks the runs kind: not ranked
        _row("scatter", "random", "cupy:a", 96.0),
        _row("scatter", "runs", "cupy:a", 96.0),
        _row("scatter", "random", "cupy:b", 98.0, False),  # not bit-exact: never wins
        _row("scatter", "runs", "cupy:b", 98.0),
        _row("copy_runs", "runs (K=3)", "cupy:a", 90.0),
        _row("copy_runs", "runs (K=3)", "cupy:b", 97.0),
        _row("gather (views at element 1)", "random", "cupy:a", 99.9),
        {"op": "ERROR", "indices": "-", "impl": "cupy:d", "bit_exact": "RuntimeError()"},
    ]
    summary = bench_kernels.summarize(rows)
    assert "best gather: b (mean 93.0% of copy: random 91.0%, runs 95.0%)" in summary
    assert "best scatter: a" in summary and "best copy_runs: b" in summary
    assert summary.endswith("DEFAULT_VARIANTS = {'gather': 'b', 'scatter': 'a', 'copy_runs': 'b'}")
    assert "no CuPy kernels" in bench_kernels.summarize(rows[:2])
