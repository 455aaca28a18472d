"""The ``mopd`` console script (profiling/cli.py) and the CSV plotter (profiling/plots.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from mopd.profiling import cli
from mopd.profiling.plots import choose_columns, plot_csv, read_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_console_script_help_lists_subcommands() -> None:
    exe = shutil.which("mopd", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "mopd.profiling.cli"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for sub in ("demo", "plan", "bench"):
        assert sub in proc.stdout


def test_bench_unknown_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


def test_no_subcommand_and_leading_junk_exit_2() -> None:
    for argv in ([], ["--zz", "demo"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2, argv


def test_demo_gets_every_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType("mopd.profiling.demo")
    fake.main = lambda argv: seen.append(list(argv)) or 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mopd.profiling.demo", fake)
    assert cli.main(["demo", "--help", "--steps", "3", "bench"]) == 5
    assert seen == [["--help", "--steps", "3", "bench"]]


def test_plan_missing_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "mopd.profiling.plan_inspector", None)  # -> not found
    assert cli.main(["plan", "--x"]) == 2
    assert "mopd.profiling.plan_inspector is not available" in capsys.readouterr().err


def test_broken_import_inside_target_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(cli.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="cupy"):
        cli.main(["demo"])


FAKE_BENCH = """
import csv, os, sys
from pathlib import Path

out = Path(os.environ["FAKE_BENCH_DIR"])
if "--fail" in sys.argv:
    sys.exit(3)
rows = int(sys.argv[sys.argv.index("--rows") + 1])
with (out / "fake-new.csv").open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["op", "bytes", "GB/s", "pct_of_copy_%"])
    for i in range(rows):
        w.writerow([f"op{i}", 1 << (20 + i), 100.0 * (i + 1), 10.0 * (i + 1)])
print("ARGS", sys.argv[1:])
"""


@pytest.fixture
def fake_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bench module on sys.path (and PYTHONPATH for the child) writing CSVs to a temp dir."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "fake_mopd_bench.py").write_text(FAKE_BENCH)
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    monkeypatch.setenv("FAKE_BENCH_DIR", str(results))
    monkeypatch.setattr(cli, "bench_module", lambda name: "fake_mopd_bench")
    return results


def test_bench_runs_module_and_plots_new_csv(
    fake_bench: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    old = _write(fake_bench / "old.csv", "op,ms\nx,1.0\n")
    rc = cli.main(["bench", "--results-dir", str(fake_bench), "kernels", "--rows", "3", "--help"])
    assert rc == 0
    out = capfd.readouterr().out
    assert "ARGS ['--rows', '3', '--help']" in out
    png = fake_bench / "fake-new.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    assert not old.with_suffix(".png").exists()  # untouched CSVs are not re-plotted


def test_bench_failure_propagates_without_plot(fake_bench: Path) -> None:
    rc = cli.main(["bench", "--results-dir", str(fake_bench), "kl", "--fail"])
    assert rc == 3
    assert list(fake_bench.glob("*.png")) == []


def test_bench_module_absent_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "bench_module", lambda name: "mopd_no_such_bench_module")
    assert cli.main(["bench", "capture"]) == 2
    assert "mopd_no_such_bench_module is not installed" in capsys.readouterr().err


def test_plot_csv_writes_png(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    csv_path = _write(
        tmp_path / "kernels.csv",
        """
        kernel,dtype,rows,time_ms,GB/s,pct_of_copy_%
        gather,bf16,131072,0.61,3746.5,90.1
        scatter,bf16,131072,0.60,3814.0,92.0
        copy,bf16,131072,0.54,4244.0,100
        """,
    )
    png = plot_csv(csv_path, tmp_path / "out" / "kernels.png")
    assert png == tmp_path / "out" / "kernels.png"
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    image = mpimg.imread(png)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image.std() > 0  # something was drawn


def test_column_choice() -> None:
    header = ["kernel", "dtype", "rows", "time_ms", "GB/s", "pct_of_copy_%"]
    rows = [dict(zip(header, r, strict=True)) for r in [["a", "bf16", "1", "2", "3", "4"]]]
    assert choose_columns(header, rows) == ("kernel", "GB/s")  # throughput first
    no_bw = [c for c in header if c != "GB/s"]
    assert choose_columns(no_bw, rows) == ("kernel", "time_ms")  # then time
    assert (
        choose_columns(["name", "rows", "share %"], [{"name": "a", "rows": "1", "share %": "9"}])[1]
        == "share %"
    )
    # No unit in any header: the first numeric column; no text column: no label column.
    assert choose_columns(["n", "v"], [{"n": "1", "v": "2"}]) == (None, "n")
    assert choose_columns(header, rows, value_column="rows") == ("kernel", "rows")
    with pytest.raises(ValueError, match="'dtype' is not a numeric column"):
        choose_columns(header, rows, value_column="dtype")
    with pytest.raises(ValueError, match="no numeric column"):
        choose_columns(["a", "b"], [{"a": "x", "b": "y"}])


def test_repeated_labels_are_widened_and_blanks_tolerated(tmp_path: Path) -> None:
    from mopd.profiling.plots import _labels

    csv_path = _write(
        tmp_path / "kl.csv",
        """
        impl,shape,ms,extra_GiB
        torch,T=1024,10.5,
        torch,T=8192,105,38.4
        chunked,T=8192,nan,5.9
        """,
    )
    header, rows = read_csv(csv_path)
    label, value = choose_columns(header, rows)
    assert (label, value) == ("impl", "ms")
    assert _labels(header, rows, label, value) == [
        "torch | T=1024",
        "torch | T=8192",
        "chunked | T=8192",
    ]
    assert plot_csv(csv_path, tmp_path / "kl.png").stat().st_size > 1000
    empty = _write(tmp_path / "empty.csv", "a,b\n")
    with pytest.raises(ValueError, match="no header or no data rows"):
        plot_csv(empty, tmp_path / "empty.png")
