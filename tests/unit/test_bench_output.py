"""Tier 1: what ``mopd bench ranges`` and ``mopd bench capture`` record and draw.

The ranges plot exists to show the near-zero cost of the OFF rows beside peers that cost tens
of times more: it must be on a log axis. A capture run on a CPU must say, in its table, notes
and plot, that its figures are functional (there, the reused-buffer "gather" is a copy timed on
shared cores, and a ratio such as "87x slower" means nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mopd.profiling.bench import capture as bench_capture
from mopd.profiling.bench import ranges as bench_ranges

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ranges_records_csv_md_and_its_own_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        bench_ranges.main(["--iters", "200", "--repeat", "1", "--results-dir", str(tmp_path)]) == 0
    )
    out = capsys.readouterr().out
    assert out.count("| case |") == 1  # the table is printed once
    (csv_path,) = tmp_path.glob("ranges-*.csv")
    assert " OFF" in csv_path.read_text()
    assert csv_path.with_suffix(".md").exists()
    # named after the CSV: mopd bench keeps it instead of drawing its generic bar chart
    assert csv_path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_ranges_plot_axis_is_logarithmic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    scales = []
    save = Figure.savefig

    def record_scale(self, *a, **k):  # type: ignore[no-untyped-def]
        scales.append(self.axes[0].get_xscale())
        return save(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", record_scale)
    rows = [
        {"case": "empty call (floor)", "time_ns": 17.0, "x_vs_nullcontext": 0.1},
        {"case": "contextlib.nullcontext() fresh", "time_ns": 200.0, "x_vs_nullcontext": 1.0},
        {"case": "ranges.span('pack') OFF", "time_ns": 210.0, "x_vs_nullcontext": 1.05},
        {"case": "record_function alone", "time_ns": 4500.0, "x_vs_nullcontext": 22.5},
    ]
    bench_ranges.plot(rows, tmp_path / "r.png", "ranges")
    assert scales == ["log"]


def test_ranges_bad_flags_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_ranges.main(["--iters", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--iters and --repeat must be >= 1" in err


def test_capture_plot_carries_the_cpu_caveat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    titles = []
    save = Figure.savefig

    def record_title(self, *a, **k):  # type: ignore[no-untyped-def]
        titles.append(self.axes[0].get_title())
        return save(self, *a, **k)

    monkeypatch.setattr(Figure, "savefig", record_title)
    rows = [
        {"path": "reused buffer (mopd)", "shape": "[256,2,512] bf16", "ms/step": 26.0},
        {"path": "all_gather + cat (naive)", "shape": "[256,2,512] bf16", "ms/step": 0.3},
    ]
    bench_capture.plot(rows, tmp_path / "c.png", "capture", cpu=True)
    bench_capture.plot(rows, tmp_path / "g.png", "capture", cpu=False)
    assert "functional figures" in titles[0] and "not performance" in titles[0]
    assert "functional" not in titles[1]


def test_a_record_never_replaces_an_earlier_one_of_the_same_day(tmp_path: Path) -> None:
    """Runs kept in one folder (``--results-dir docs/results``) keep each other: a second run of
    the same name on the same machine and day takes the next suffix."""
    from mopd.profiling.results import environment, record

    env = environment()
    paths = [record("same", [{"case": "a", "n": k}], out_dir=tmp_path, env=env) for k in (1, 2, 3)]
    stems = [csv.stem for csv, _ in paths]
    first = stems[0]
    assert first.startswith("same-") and stems[1:] == [f"{first}-2", f"{first}-3"]
    for k, (csv, md) in enumerate(paths, start=1):
        assert csv.read_text().splitlines()[1] == f"a,{k}"  # each run's own rows, none replaced
        assert md == csv.with_suffix(".md") and md.exists()


def test_tables_print_times_and_sizes_as_a_person_writes_them() -> None:
    """A column of times is headed without its unit suffix and each time carries the unit that
    suits it; no number of everyday size is printed with an exponent."""
    from mopd.common.units import human_seconds
    from mopd.profiling.results import format_table

    table = format_table(
        [
            {"case": "a", "time_ns": 14950.3, "fwd_bwd_ms": 0.25, "setup_s": 3.0, "n": 123456.7},
            {"case": "b", "time_ns": 104.2, "fwd_bwd_ms": "OOM", "setup_s": 0.0005, "n": 0.01234},
        ]
    )
    assert table.splitlines() == [
        "| case | time | fwd_bwd | setup | n |",
        "|---|---|---|---|---|",
        "| a | 14.95 µs | 250 µs | 3 s | 123457 |",
        "| b | 104.2 ns | OOM | 500 µs | 0.01234 |",
    ]
    assert "e+" not in table
    assert [human_seconds(x) for x in (2.5e-9, 1.5e-6, 0.0421, 75.0)] == [
        "2.5 ns",
        "1.5 µs",
        "42.1 ms",
        "75 s",
    ]
