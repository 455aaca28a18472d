"""Tier 2 (launch): ``pip install .`` (not editable) ships the ``mopd`` namespace and nothing generic.

Builds the wheel from this checkout, installs it into a temporary folder and imports it from
there in a fresh interpreter, away from the source tree.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("capture", "bridge", "kernels", "profiling", "common", "mcore")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        cwd=out,
        timeout=300,
    )
    (whl,) = out.glob("mopd_bridge-*.whl")
    return whl


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
    src_cu = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert sorted(n.split("/")[-1] for n in names if n.endswith(".cu")) == src_cu
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


def test_installed_wheel_runs_the_demo_outside_the_checkout(site: Path, tmp_path: Path):
    """The main job needs no checkout: the CPU support for megatron-core ships in the package
    (``mopd.mcore.cpu``). Installed into a fresh folder and run from a temporary directory, a
    4-rank ``mopd demo --steps 1`` verifies its bridged rows."""
    env = {
        "PYTHONPATH": str(site),
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "OMP_NUM_THREADS": "1",
        "HOME": str(tmp_path),
    }
    where = subprocess.run(
        [
            sys.executable,
            "-c",
            "import mopd.mcore.cpu as m, mopd.profiling.demo_job as d; print(m.__file__, d.__file__)",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert where.returncode == 0, where.stderr
    assert all(p.startswith(str(site)) for p in where.stdout.split()), where.stdout
    argv = ["--steps", "1", "--nproc", "4", "--teacher", "tp=2", "--teacher", "tp=2,rank_offset=2"]
    argv += ["--student", "tp=2,cp=2", "--timeout", "200"]
    proc = subprocess.run(
        [sys.executable, "-m", "mopd.profiling.demo", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "verification: OK" in proc.stdout


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
