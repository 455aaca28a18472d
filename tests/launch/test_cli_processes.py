"""Tier 2 (launch): the ``mopd`` command and the tools, each run as its own process.

What a user meets from a shell: the console script and ``python -m mopd`` answer, misuse is one
line and exit 2 before anything heavy is imported, and ``mopd bench capture --quick`` on CPU
labels its figures functional; ``mopd bench NAME`` runs the benchmark as a child process, hands
it its arguments and plots what it wrote. Each test starts an interpreter: not tier 1.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from mopd.profiling import cli, extras
from tests.support.processes import run_module

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_console_script_help_lists_subcommands() -> None:
    exe = shutil.which("mopd", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "mopd.profiling.cli"]
    proc = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for sub in ("demo", "plan", "bench"):
        assert sub in proc.stdout


def test_python_dash_m_mopd_is_the_same_command(tmp_path: Path) -> None:
    """``python -m mopd`` from a folder that is not the checkout (the installed namespace)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mopd", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mopd (mopd-bridge) {metadata.version('mopd-bridge')}"


def test_misuse_answers_before_heavy_imports() -> None:
    code = (
        "import sys\n"
        "from mopd.profiling import cli\n"
        "try:\n"
        "    cli.main(['bench', 'nosuch'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, sorted(m for m in ('torch', 'numpy', 'matplotlib', 'megatron')"
        " if m in sys.modules))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.stdout.strip() == "2 []", (proc.stdout, proc.stderr)


def test_bad_flags_fail_before_torch_is_imported() -> None:
    code = (
        "import sys\n"
        "from mopd.profiling import cli\n"
        "rc = cli.main(['plan', '--teacher', 'tp=2,abc', '--student', 'tp=2', '--batch', '2',"
        " '--seq-len', '8'])\n"
        "print(rc, 'torch' in sys.modules, 'numpy' in sys.modules)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert res.stdout.split()[:2] == ["2", "False"], (res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and "'abc' is not KEY=VALUE" in res.stderr


def test_capture_quick_cpu_run_is_labelled_functional(tmp_path: Path) -> None:
    res = run_module(  # the benchmark picks a free port
        "mopd.profiling.bench.capture", "--quick", "--iters", "2", "--results-dir", str(tmp_path)
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("| path |") == 1
    (csv_path,) = tmp_path.glob("capture-cpu-*.csv")
    assert "functional (CPU)" in csv_path.read_text()
    with csv_path.open() as f:
        allocs = {r["path"]: float(r["allocations/step"]) for r in csv.DictReader(f)}
    assert allocs["capture, out= (mopd zero-allocation path)"] == 0
    assert allocs["all_gather + cat (naive)"] > 0
    assert "CPU run: functional figures" in csv_path.with_suffix(".md").read_text()
    assert csv_path.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


FAKE_BENCH = """
import csv, os, sys
from pathlib import Path

out = Path(os.environ["FAKE_BENCH_DIR"])
if "--fail" in sys.argv:
    sys.exit(3)
rows = int(sys.argv[sys.argv.index("--rows") + 1])
if "--results-dir" in sys.argv:
    assert Path(sys.argv[sys.argv.index("--results-dir") + 1]) == out
with (out / "fake-new.csv").open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["op", "bytes", "GB/s", "pct_of_copy_%"])
    for i in range(rows):
        w.writerow([f"op{i}", 1 << (20 + i), 100.0 * (i + 1), 10.0 * (i + 1)])
if "--own" in sys.argv:
    (out / "fake-new-errors.png").write_bytes(b"own plot")
print("ARGS", sys.argv[1:])
print("PROG", os.environ.get("MOPD_PROG"), "SAID", os.environ.get("MOPD_EXTRAS_SAID"))
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
    rc = cli.main(["bench", "--results-dir", str(fake_bench), "kernels", "--rows", "3", "-v"])
    assert rc == 0
    out = capfd.readouterr().out
    # the results folder reaches the benchmark; its own arguments follow untouched
    assert f"ARGS ['--results-dir', '{fake_bench}', '--rows', '3', '-v']" in out
    assert "PROG mopd bench kernels " in out  # its usage and errors name the command as typed
    png = fake_bench / "fake-new.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    assert not old.with_suffix(".png").exists()  # untouched CSVs are not re-plotted


def test_bench_keeps_a_plot_the_benchmark_drew(
    fake_bench: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--results-dir", str(fake_bench), "kl", "--rows", "2", "--own"]) == 0
    out = capfd.readouterr().out
    own = fake_bench / "fake-new-errors.png"
    assert own.read_bytes() == b"own plot"  # not redrawn
    assert not (fake_bench / "fake-new.png").exists()
    assert f"plot {own} (the benchmark's)" in out


def test_bench_results_dir_after_name_is_the_benchmarks(
    fake_bench: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rc = cli.main(["bench", "ranges", "--rows", "1", "--results-dir", str(fake_bench)])
    assert rc == 0
    assert (fake_bench / "fake-new.png").exists()  # plotted where the benchmark wrote
    capfd.readouterr()
    rc = cli.main(["bench", "--results-dir", str(fake_bench), "ranges", "--results-dir", "x"])
    assert rc == 2
    err = capfd.readouterr().err
    assert "--results-dir given twice" in err and err.count("\n") == 1


def test_a_benchmarks_usage_error_is_its_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "ranges", "--iters", "0"]) == 2
    err = capfd.readouterr().err
    assert err == (
        "mopd bench ranges: error: --iters and --repeat must be >= 1, got 0, 5 "
        "(see mopd bench ranges --help)\n"
    )


def test_bench_help_is_the_benchmarks_own_named_as_typed(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mopd bench ranges --help``: the benchmark's help and nothing else (no note about a
    missing extra before it, none about a CSV after it), its usage ``mopd bench ranges``, its
    defaults shown; run directly, the usage is the ``python -m`` command."""
    asked: list[object] = []
    monkeypatch.setattr(extras, "optional_module", lambda *a, **k: asked.append(a))
    assert cli.main(["bench", "ranges", "--help"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("usage: mopd bench ranges ["), out[:200]
    assert "(default: 50000)" in " ".join(out.split())
    assert err == "" and asked == []
    res = subprocess.run(
        [sys.executable, "-m", "mopd.profiling.bench.ranges", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "MOPD_PROG"},
    )
    assert res.stdout.startswith("usage: python -m mopd.profiling.bench.ranges ["), res.stdout
    assert res.stderr == ""


def test_bench_without_matplotlib_says_so_once_after_the_run(
    fake_bench: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(extras, "has_module", lambda name: name != "matplotlib")
    monkeypatch.setattr(extras, "can_draw", lambda tool: said.append(tool) or False)
    assert cli.main(["bench", "--results-dir", str(fake_bench), "kl", "--rows", "1"]) == 0
    out = capfd.readouterr().out
    assert said == ["mopd bench"]  # once, by the command, after the benchmark's output
    said_to_child = out.split("SAID ")[1].split()[0]
    assert "matplotlib" in said_to_child.split(",")  # so the benchmark does not say it too
    assert not list(fake_bench.glob("*.png"))


def test_bench_failure_propagates_without_plot(fake_bench: Path) -> None:
    rc = cli.main(["bench", "--results-dir", str(fake_bench), "kl", "--fail"])
    assert rc == 3
    assert list(fake_bench.glob("*.png")) == []


def test_a_note_said_by_the_parent_is_not_said_again_by_a_child() -> None:
    code = (
        "from mopd.profiling import extras;"
        "assert extras.optional_module('mopd_test_no_such_module', purpose='p') is None"
    )
    env = {**extras.child_env(), "MOPD_EXTRAS_SAID": "mopd_test_no_such_module"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
