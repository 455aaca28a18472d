"""The ``mopd`` console script (profiling/cli.py), the CSV plotter (profiling/plots.py) and where
results go (profiling/results.py)."""

from __future__ import annotations

import sys
import textwrap
import types
from importlib import metadata
from pathlib import Path

import pytest

from mopd.profiling import cli, results
from mopd.profiling.plots import choose_columns, draw_csv, plot_csv, read_csv

ROOT = Path(__file__).resolve().parents[2]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def test_version_from_the_installed_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"mopd (mopd-bridge) {metadata.version('mopd-bridge')}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "nosuch"], "mopd bench: error: argument name: invalid choice: 'nosuch'"),
        ([], "mopd: error: the following arguments are required: {demo,plan,bench,nsys}"),
        (["--zz", "demo"], "mopd: error: unrecognized arguments before 'demo': --zz"),
        (
            ["frobnicate"],
            "mopd: error: argument {demo,plan,bench,nsys}: invalid choice: 'frobnicate'",
        ),
    ],
)
def test_misuse_is_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2, argv
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


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
    monkeypatch.setitem(sys.modules, "mopd.profiling.plan", None)  # -> not found
    assert cli.main(["plan", "--x"]) == 2
    assert "mopd.profiling.plan is not available" in capsys.readouterr().err


def test_broken_import_inside_target_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(name: str) -> types.ModuleType:
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    monkeypatch.setattr(cli.importlib, "import_module", broken)
    with pytest.raises(ModuleNotFoundError, match="cupy"):
        cli.main(["demo"])


def test_bench_module_absent_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "bench_module", lambda name: "mopd_no_such_bench_module")
    assert cli.main(["bench", "capture"]) == 2
    assert "mopd_no_such_bench_module is not installed" in capsys.readouterr().err


def test_results_go_to_the_checkout_or_mopd_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # this test runs from a checkout: mopd-results/ at its root, which git ignores (a run leaves
    # no untracked file in the checkout)
    assert results.default_results_dir() == ROOT / "mopd-results"
    assert "mopd-results/" in (ROOT / ".gitignore").read_text().splitlines()
    # an installed package used elsewhere: ./mopd-results
    monkeypatch.setattr(results, "checkout_root", lambda: None)
    assert results.default_results_dir() == Path("mopd-results")
    assert not results._is_checkout(tmp_path)
    (tmp_path / "profiling").mkdir()
    (tmp_path / "profiling" / "results.py").write_text("")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "mopd-bridge"\n')
    assert results._is_checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    assert not results._is_checkout(tmp_path)


def test_help_says_where_results_go(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "mopd-results/ at the root of a checkout of mopd-bridge (git ignores it), "
        "./mopd-results/ elsewhere" in out
    )
    assert "functional" in out  # CPU figures


def test_progress_is_quiet_off_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with results.Progress(total=2, desc="x") as bar:  # pytest's stderr is not a terminal
        bar.start("a")
        bar.step()
        assert not bar.shown
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with results.Progress(total=2, desc="bench", quiet=True) as bar:  # --json
        assert not bar.shown
    with results.Progress(total=2, desc="bench") as bar:
        assert bar.shown
        bar.start("case one")
        bar.step()
    captured = capsys.readouterr()
    assert captured.out == "" and "bench" in captured.err and "case one" in captured.err


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


def test_log_scale_when_values_span_decades(tmp_path: Path) -> None:
    wide = _write(tmp_path / "ranges.csv", "case,time_ns\nfloor,17\nspan off,140\nrecord,4538\n")
    narrow = _write(tmp_path / "k.csv", "kernel,GB/s\ncopy,4244\nindex_copy,1395\n")
    assert draw_csv(wide).axes[0].get_xscale() == "log"
    assert draw_csv(narrow).axes[0].get_xscale() == "linear"
    assert "log scale" in draw_csv(wide).axes[0].get_xlabel()


def test_cpu_runs_say_their_figures_are_functional(tmp_path: Path) -> None:
    cpu = _write(tmp_path / "kl-cpu-2026-12-01.csv", "impl,ms\nours,1.5\ntorch,130\n")
    gpu = _write(tmp_path / "kl-nvidia_h200-2026-12-01.csv", "impl,ms\nours,1.5\ntorch,130\n")
    assert "functional figures" in draw_csv(cpu).axes[0].get_title()
    assert "functional" not in draw_csv(gpu).axes[0].get_title()


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
