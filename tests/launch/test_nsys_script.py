"""profiling/nsys.sh against a fake ``nsys`` that records its argv: traces, per-rank reports,
torchrun rewriting, a clear exit 2 where nsys is absent (a ``--dry-run`` needs none); and
``mopd nsys``, the same script from the installed package (what a pip user has), naming itself
in its messages."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "profiling" / "nsys.sh"

# A stand-in for nsys: answers `nsys profile --help` with a --trace section that lists nccl only
# when FAKE_NSYS_NCCL=1, and otherwise records one file per call: the env it cares about, then
# its argv one per line.
FAKE_NSYS = r"""#!/usr/bin/env bash
if [[ ${1:-} == profile && ${2:-} == --help ]]; then
    printf 'usage: nsys profile [<args>] [application]\n\n'
    printf '\t-t, --trace=\n\n\t   Possible values: cuda, nvtx, osrt, mpi%s, none\n' \
        "$([[ ${FAKE_NSYS_NCCL:-0} == 1 ]] && echo ', nccl')"
    printf '\t   Default is cuda,opengl,nvtx,osrt\n\n\t-s, --sample=\n\t   see nccl docs\n'
    exit 0
fi
log="$FAKE_NSYS_LOG/call-$$"
{
    echo "RANK=${RANK:-unset}"
    echo "MOPD_NVTX=${MOPD_NVTX:-unset}"
    printf '%s\n' "$@"
} >"$log"
exit "${FAKE_NSYS_RC:-0}"
"""


def _path_without_nsys() -> str:
    """The current PATH minus every folder holding an ``nsys``."""
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d]
    return os.pathsep.join(d for d in dirs if not (Path(d) / "nsys").exists())


@pytest.fixture
def fake(tmp_path: Path) -> dict[str, str]:
    """Env with the fake nsys first on PATH and no inherited rank / profiling settings."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nsys = bin_dir / "nsys"
    nsys.write_text(FAKE_NSYS)
    nsys.chmod(0o755)
    log_dir = tmp_path / "calls"
    log_dir.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MOPD_NVTX", "MOPD_NSYS_OUT"}
        and not k.startswith(("TORCHELASTIC", "MOPD_NSYS"))
    }
    env["PATH"] = os.pathsep.join(
        [str(bin_dir), str(Path(sys.executable).parent), _path_without_nsys()]
    )
    env["FAKE_NSYS_LOG"] = str(log_dir)
    env["FAKE_NSYS_NCCL"] = "1"
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def _calls(env: dict[str, str]) -> list[tuple[dict[str, str], list[str]]]:
    """Each recorded nsys call as (env facts, argv)."""
    out = []
    for path in sorted(Path(env["FAKE_NSYS_LOG"]).glob("call-*")):
        lines = path.read_text().splitlines()
        facts = dict(line.split("=", 1) for line in lines[:2])
        out.append((facts, lines[2:]))
    return out


def test_missing_nsys_exits_2_with_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    env["PATH"] = _path_without_nsys()
    assert shutil.which("nsys", path=env["PATH"]) is None
    proc = _run(["--", "echo", "never"], env, tmp_path)
    assert proc.returncode == 2, proc
    assert "nsys (Nsight Systems CLI) is not on PATH" in proc.stderr
    assert "never" not in proc.stdout


def test_dry_run_needs_no_nsys(tmp_path: Path) -> None:
    """``--dry-run`` prints the command it would run, nsys named in it, without nsys installed:
    the torchrun rewrite, each rank under ``nsys profile``, the default trace list."""
    env = {k: v for k, v in os.environ.items() if k not in {"RANK", "MOPD_NSYS_OUT"}}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), _path_without_nsys()])
    assert shutil.which("nsys", path=env["PATH"]) is None
    proc = _run(
        ["--dry-run", "--out", "r", "--", "torchrun", "--nproc-per-node", "2", "x.py"],
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert argv[:4] == ["torchrun", "--nproc-per-node", "2", "--no-python"]
    assert argv[4:7] == ["nsys", "profile", "--trace=cuda,nvtx,osrt"]
    assert "--output=r/report-rank%q{RANK}" in argv and argv[-1] == "x.py"
    assert not (tmp_path / "r").exists()  # nothing made, nothing run
    proc = _mopd_nsys(["--dry-run", "--", "echo", "hi"], env, tmp_path)
    assert proc.returncode == 0 and shlex.split(proc.stdout)[:2] == ["nsys", "profile"], proc


def test_plain_command_traces_and_report_name(fake: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "reports"
    proc = _run(["--out", str(out), "--", "echo", "a b", "--flag"], fake, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.is_dir()
    [(facts, argv)] = _calls(fake)
    assert facts == {"RANK": "unset", "MOPD_NVTX": "1"}
    assert argv[0] == "profile"
    assert "--trace=cuda,nvtx,osrt,nccl" in argv
    assert f"--output={out}/report-%h-%p" in argv
    assert argv[-3:] == ["echo", "a b", "--flag"]


def test_inside_a_rank_names_report_by_rank(fake: dict[str, str], tmp_path: Path) -> None:
    env = {**fake, "RANK": "3", "FAKE_NSYS_NCCL": "0"}
    proc = _run(["--out", "r", "--", "true"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    [(facts, argv)] = _calls(env)
    assert facts["RANK"] == "3"
    # nccl is added only when this nsys lists it under --trace (the fake mentions nccl elsewhere).
    assert "--trace=cuda,nvtx,osrt" in argv
    assert "--output=r/report-rank%q{RANK}" in argv
    assert argv[-1] == "true"


def test_torchrun_puts_nsys_inside_each_rank(fake: dict[str, str], tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    assert torchrun.exists(), "torchrun is part of the test environment"
    out = tmp_path / "reports"
    args = ["--out", str(out), "--", str(torchrun), "--nproc-per-node", "2", "--no-python"]
    proc = _run([*args, "true", "--x", "1"], fake, tmp_path)
    assert proc.returncode == 0, proc.stderr
    calls = _calls(fake)
    assert sorted(facts["RANK"] for facts, _ in calls) == ["0", "1"]
    for facts, argv in calls:
        assert facts["MOPD_NVTX"] == "1"
        assert "--trace=cuda,nvtx,osrt,nccl" in argv
        assert f"--output={out}/report-rank%q{{RANK}}" in argv
        assert argv[-3:] == ["true", "--x", "1"]


def test_torchrun_module_form_is_rewritten(fake: dict[str, str], tmp_path: Path) -> None:
    cmd = ["torchrun", "--nproc-per-node", "2", "-m", "pkg.mod", "--steps", "3", "-m", "x"]
    proc = _run(["--dry-run", "--out", "o", "--", *cmd], fake, tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    nsys = str(Path(fake["PATH"].split(os.pathsep)[0]) / "nsys")
    at = argv.index(nsys)
    assert argv[:at] == ["torchrun", "--nproc-per-node", "2", "--no-python"]
    assert "--output=o/report-rank%q{RANK}" in argv[at:]
    # The program: the launcher's python -m the module, its own -m kept.
    tail = argv[argv.index("--output=o/report-rank%q{RANK}") + 1 :]
    assert Path(tail[0]).name.startswith("python")
    assert tail[1:] == ["-m", "pkg.mod", "--steps", "3", "-m", "x"]
    assert _calls(fake) == []  # dry run ran nothing


def test_trace_override_extra_args_and_default_command(
    fake: dict[str, str], tmp_path: Path
) -> None:
    proc = _run(["--trace", "cuda,nvtx", "--nsys-arg=--sample=none", "--out", "o"], fake, tmp_path)
    assert proc.returncode == 0, proc.stderr
    [(_, argv)] = _calls(fake)
    assert "--trace=cuda,nvtx" in argv and "--sample=none" in argv
    if shutil.which("mopd", path=fake["PATH"]):
        assert argv[-2:] == ["mopd", "demo"]
    else:
        assert argv[-3:] == ["-m", "mopd.profiling.cli", "demo"]


def test_exit_status_and_bad_usage(fake: dict[str, str], tmp_path: Path) -> None:
    proc = _run(["--", "true"], {**fake, "FAKE_NSYS_RC": "7"}, tmp_path)
    assert proc.returncode == 7
    proc = _run(["--bogus"], fake, tmp_path)
    assert proc.returncode == 2 and "unknown option '--bogus'" in proc.stderr
    proc = _run(["--help"], fake, tmp_path)
    assert proc.returncode == 0 and "--nsys-arg" in proc.stdout


def _mopd_nsys(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mopd", "nsys", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mopd_nsys_is_the_packaged_script() -> None:
    from mopd.profiling.cli import nsys_script

    packaged = nsys_script()
    assert packaged.name == "nsys.sh" and packaged.read_text() == SCRIPT.read_text()
    import mopd.profiling

    assert packaged.parent == Path(mopd.profiling.__file__).parent  # beside the installed code


def test_mopd_nsys_profiles_a_command_like_the_script(fake: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "reports"
    proc = _mopd_nsys(["--out", str(out), "--", "echo", "a b"], fake, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"mopd nsys: reports go to {out}" in proc.stderr
    [(facts, argv)] = _calls(fake)
    assert facts == {"RANK": "unset", "MOPD_NVTX": "1"}
    assert "--trace=cuda,nvtx,osrt,nccl" in argv and f"--output={out}/report-%h-%p" in argv
    assert argv[-2:] == ["echo", "a b"]


def test_mopd_nsys_default_command_and_torchrun_from_this_python(
    fake: dict[str, str], tmp_path: Path
) -> None:
    dirs = [d for d in fake["PATH"].split(os.pathsep) if not (Path(d) / "mopd").exists()]
    env = {**fake, "PATH": os.pathsep.join(dirs)}  # the fake nsys, no mopd console script
    proc = _mopd_nsys(["--dry-run", "--out", "o"], env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    # no mopd console script on PATH: the demo through the interpreter that ran `mopd nsys`
    assert argv[-4:] == [sys.executable, "-m", "mopd.profiling.cli", "demo"]


def test_mopd_nsys_usage_errors_and_help_name_it(fake: dict[str, str], tmp_path: Path) -> None:
    proc = _mopd_nsys(["--bogus"], fake, tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("mopd nsys: unknown option '--bogus'")
    proc = _mopd_nsys(["--help"], fake, tmp_path)
    assert proc.returncode == 0 and "mopd nsys [--out DIR]" in proc.stdout
    env = {**fake, "PATH": _path_without_nsys()}
    proc = _mopd_nsys(["--", "true"], env, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("mopd nsys: nsys (Nsight Systems CLI) is not on PATH")
