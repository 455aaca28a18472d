"""Tier 2 (launch): the wheel, installed the way a user installs it, ships what the README promises.

Builds the wheel from this checkout, with no deprecation from the build backend. It holds the
``mopd`` namespace and nothing generic, and imports from a plain folder away from the source
tree. Then, as a new user would: a fresh virtual environment, the torch pin of the Makefile
first, the wheel with only its declared dependencies (``mopd demo`` then says in one line, before
any rank starts, which extra it needs), then the wheel with the extra the README's install line
names, and from an empty folder the commands the README shows with it: ``mopd --version``,
``mopd demo --steps 1`` (verifies; its output is a log here: no progress bar, no note about
one), the README's ``mopd plan`` example (writes its report) and ``mopd nsys`` (the packaged
script: its help, and its one-line refusal where Nsight Systems is not installed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("capture", "bridge", "kernels", "profiling", "common", "mcore")


@dataclass(frozen=True)
class Wheel:
    path: Path
    build_output: str  # what pip and the build backend printed


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Wheel:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
        ],
        cwd=out,
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("mopd_bridge-*.whl")
    return Wheel(path=whl, build_output=proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def wheel(built: Wheel) -> Path:
    return built.path


def test_the_build_warns_of_no_deprecation(built: Wheel) -> None:
    """The package's metadata is what the build backend asks for today (the license as an SPDX
    expression): a build says nothing is deprecated."""
    lines = [x for x in built.build_output.splitlines() if re.search(r"deprecat", x, re.I)]
    assert not lines, "\n".join(lines)


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed (no dependencies) into a fresh folder, away from the checkout."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=300,
    )
    return target


def test_wheel_holds_only_the_mopd_namespace(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"mopd", next(t for t in tops if t.endswith(".dist-info"))}
    assert "mopd/__init__.py" not in names  # a namespace, shared with nothing generic
    assert "mopd/__main__.py" in names  # python -m mopd
    for sub in SUBPACKAGES:
        assert f"mopd/{sub}/__init__.py" in names
        assert f"mopd/{sub}/py.typed" in names
    assert not any("/results/" in n for n in names)
    assert "mopd/profiling/nsys.sh" in names  # what `mopd nsys` runs
    for family in ("kl", "rows"):  # each kernel family ships as its own package, sources too
        assert f"mopd/kernels/{family}/__init__.py" in names
    kernels = ROOT / "kernels"
    src_cu = sorted(
        f"mopd/kernels/{p.relative_to(kernels).as_posix()}" for p in kernels.rglob("*.cu")
    )
    assert len(src_cu) >= 2
    assert sorted(n for n in names if n.endswith(".cu")) == src_cu
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mopd = mopd.profiling.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_installed_wheel_imports_away_from_the_checkout(site: Path, tmp_path: Path):
    code = (
        "import mopd.capture, mopd.bridge, mopd.kernels, mopd.profiling, sys;"
        "from mopd.capture import OutputLayerInputCapture, get_opd_full_capture_context;"
        "print(mopd.capture.__file__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(site))


def test_installed_wheel_runs_python_dash_m_mopd(wheel: Path, site: Path, tmp_path: Path):
    """``python -m mopd`` and ``--version`` from the wheel alone, away from the checkout."""
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    want = wheel.name.split("-")[1]  # mopd_bridge-<version>-py3-none-any.whl
    res = subprocess.run(
        [sys.executable, "-m", "mopd", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"mopd (mopd-bridge) {want}\n"
    code = (
        "import mopd, mopd.__main__ as m, mopd.profiling.cli as c;"
        "print(m.__file__); print(c.__file__); print(getattr(mopd, '__file__', None))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    main_file, cli_file, ns_file = res.stdout.split("\n")[:3]
    assert main_file.startswith(str(site)) and cli_file.startswith(str(site)), res.stdout
    assert ns_file == "None"  # still a namespace package
    res = subprocess.run(
        [sys.executable, "-m", "mopd", "bench", "nosuch"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr


# ---- the README's install line in a fresh environment ------------------------------------------

README = ROOT / "README.md"


def _readme_extras() -> str:
    """The extras of the README's install line (its first ``pip install '.[EXTRAS]'``)."""
    match = re.search(r"pip install '\.\[([\w,]+)\]'", README.read_text())
    assert match, "README names no install line of the form pip install '.[EXTRAS]'"
    return match[1]


def _readme_plan_args() -> list[str]:
    """The arguments of the README's ``mopd plan`` example (its Tools section)."""
    match = re.search(r"`mopd plan (--[^`]+)`", README.read_text())
    assert match, "README shows no `mopd plan ...` example"
    return match[1].split()


def _torch_pin() -> str:
    match = re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no TORCH_PIN"
    return match[1]


@dataclass(frozen=True)
class FreshInstall:
    """What a new user saw, step by step, in a fresh environment."""

    extras: str
    version: subprocess.CompletedProcess[str]
    bare_demo: subprocess.CompletedProcess[str]  # before the extra: only declared dependencies
    freeze_after_extra: str
    demo: subprocess.CompletedProcess[str]
    plan: subprocess.CompletedProcess[str]
    bench: subprocess.CompletedProcess[str]  # a small `mopd bench plan`
    nsys_help: subprocess.CompletedProcess[str]
    nsys: subprocess.CompletedProcess[str]  # `mopd nsys -- true`, no Nsight Systems here
    empty: Path  # the folder the commands ran in


@pytest.fixture(scope="module")
def fresh_install(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> FreshInstall:
    """A fresh venv: the torch pin, the wheel alone, then the wheel with the README's extras.

    No time limit on the installs and the demo beyond the demo's own (``--timeout``, raised
    here: on a busy shared machine 8 ranks start slowly); each step's outcome is kept for the
    tests below, which check one promise each.
    """
    root = tmp_path_factory.mktemp("fresh")
    venv, empty = root / "venv", root / "empty"
    empty.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", OMP_NUM_THREADS="1")
    env["PYTHONWARNINGS"] = "ignore"

    def pip(*args: str) -> None:
        subprocess.run(
            [str(bin_dir / "python"), "-m", "pip", "install", "-q", *args], env=env, check=True
        )

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / "mopd"), *args], cwd=empty, env=env, capture_output=True, text=True
        )

    pip(_torch_pin())
    pip(str(wheel))
    version = run("--version")
    bare_demo = run("demo", "--steps", "1")
    extras = _readme_extras()
    pip(f"{wheel}[{extras}]")
    freeze = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "freeze"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    demo = run("demo", "--steps", "1", "--timeout", "1800")
    plan = run("plan", *_readme_plan_args())
    bench = run("bench", "plan", "--ranks", "16", "--tokens-per-rank", "64", "--max-len", "40")
    nsys_help, nsys = run("nsys", "--help"), run("nsys", "--", "true")
    return FreshInstall(
        extras=extras,
        version=version,
        bare_demo=bare_demo,
        freeze_after_extra=freeze,
        demo=demo,
        plan=plan,
        bench=bench,
        nsys_help=nsys_help,
        nsys=nsys,
        empty=empty,
    )


def test_fresh_install_answers_its_version(fresh_install: FreshInstall, wheel: Path):
    res = fresh_install.version
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"mopd (mopd-bridge) {wheel.name.split('-')[1]}\n"


def test_demo_without_megatron_says_which_extra_in_one_line(fresh_install: FreshInstall):
    """Before the extra: one line naming it, exit status 2, and no rank started."""
    res = fresh_install.bare_demo
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stdout == ""
    assert res.stderr.count("\n") == 1, res.stderr
    assert "megatron-core is not installed" in res.stderr and "[megatron]" in res.stderr


def test_readme_install_line_brings_megatron_but_not_the_profiling_extra(
    fresh_install: FreshInstall,
):
    """The extra is what the README says, and the tools below run without tqdm and matplotlib
    (so the fallbacks are what these tests exercise)."""
    names = {line.split("==")[0].lower() for line in fresh_install.freeze_after_extra.split()}
    assert "megatron-core" in names
    assert not {"tqdm", "matplotlib"} & names, sorted(names)


def test_fresh_install_runs_the_demo_from_an_empty_folder(fresh_install: FreshInstall):
    res = fresh_install.demo
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    assert "verification: OK" in res.stdout
    assert "Traceback" not in res.stderr, res.stderr[-5000:]
    # a log, not a terminal: no bar to draw, so no bar and no note that tqdm would add one
    assert "tqdm" not in res.stderr and "%|" not in res.stdout + res.stderr, res.stderr[-3000:]
    assert not [x for x in res.stdout.splitlines() + res.stderr.splitlines() if "eprecat" in x]
    assert "decreasing" not in res.stdout  # one step is no trend


def test_fresh_install_runs_the_readme_plan_example(fresh_install: FreshInstall):
    res = fresh_install.plan
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "bridge total:" in res.stdout and "host path" in res.stdout, res.stdout[-3000:]
    assert res.stderr == (
        "mopd plan: no picture: matplotlib is not installed (pip install "
        "'mopd-bridge[profiling]' adds it)\n"
    )
    assert not list(fresh_install.empty.glob("*.png"))


def test_fresh_install_runs_a_benchmark_and_records_it(fresh_install: FreshInstall):
    """``mopd bench`` records its CSV and Markdown under ./mopd-results; no PNG, said once."""
    res = fresh_install.bench
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = fresh_install.empty / "mopd-results"
    assert len(list(results.glob("plan-step-*.csv"))) == 1, res.stderr
    assert len(list(results.glob("plan-step-*.md"))) == 1, res.stderr
    assert not list(results.glob("*.png"))
    assert "Traceback" not in res.stderr, res.stderr
    notes = [line for line in res.stderr.splitlines() if "matplotlib is not installed" in line]
    assert notes == [
        "mopd bench: no picture: matplotlib is not installed (pip install "
        "'mopd-bridge[profiling]' adds it)"
    ], res.stderr


def test_fresh_install_has_the_nsys_command(fresh_install: FreshInstall):
    """``mopd nsys`` runs the script the wheel ships (no checkout): its help, and without
    Nsight Systems the one-line refusal naming what to install, exit status 2."""
    res = fresh_install.nsys_help
    assert res.returncode == 0 and "mopd nsys [--out DIR]" in res.stdout, res.stderr
    res = fresh_install.nsys
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("mopd nsys: nsys (Nsight Systems CLI) is not on PATH")
    assert res.stderr.count("\n") == 1
