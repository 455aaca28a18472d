"""``mopd demo``: the multi-teacher MOPD job, run for real as a subprocess (it starts torchrun).

What can fail here: the job's exit code, its step-1 verification (bridged rows against an
all-gather reference), the final table (phases and a loss per step) and its ``--json`` form, the
detection of a corrupted bridge buffer (a hidden ``--inject-mismatch`` flag must make the job exit
non-zero), and the independence of the loss from the parallelism: every weight is drawn from its
full name's seed, so the 8-rank job (student TP2 CP2 DP2, teachers TP2 DP2 and TP4), a one-rank
job, and a pipelined job (student and teacher PP=2 under megatron's 1F1B schedule, 4
micro-batches, megatron's default loss path) must give the same loss per step (each on the
response tokens: the prompts are left out by the student's loss mask, and reported as not sent).
Also: bad flags are rejected before anything starts; ``--help`` shows the defaults; every rank
records the phases it goes through (its last one: ``done``); on a terminal the progress bar
draws and no printed line lands on the bar's line, and off one there is no bar at all.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

from mopd.profiling import demo

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("plan", "teacher fwd", "student fwd+bwd", "finish", "optimizer")
SINGLE_RANK = ["--nproc", "1", "--teacher", "tp=1", "--teacher", "tp=1", "--student", "tp=1"]
FOUR_RANKS = ["--nproc", "4", "--teacher", "tp=2", "--teacher", "tp=2,rank_offset=2"]
FOUR_RANKS += ["--student", "tp=2,cp=2"]


def _run(*args: str, timeout: float = 240, **env_extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env.pop("MOPD_NVTX", None)
    return subprocess.run(
        [sys.executable, "-m", "mopd.profiling.demo", *args, "--timeout", str(timeout - 20)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _losses(stdout: str) -> list[float]:
    line = next(x for x in stdout.splitlines() if x.strip().startswith("loss (reverse KL / token)"))
    return [float(v) for v in line.split(")")[1].split()]


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def eight_ranks() -> subprocess.CompletedProcess[str]:
    return _run("--steps", "2")


def test_demo_runs_verifies_and_prints_the_table(eight_ranks) -> None:
    out = eight_ranks.stdout
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    assert re.search(
        r"^verification: OK \(step 1: \d+ bridged rows on 8 student ranks, 2 micro-batches",
        out,
        re.M,
    )
    assert "student Mesh(tp=2, cp=2, dp=2" in out and "teacher1 Mesh(tp=4" in out
    for phase in PHASES:
        row = next(x for x in out.splitlines() if x.strip().startswith(phase + " "))
        times = [float(v) for v in row.split()[-2:]]
        assert all(t >= 0 and math.isfinite(t) for t in times), row
    losses = _losses(out)
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses), losses
    links = re.findall(r"teacher(\d) r(\d) -> r(\d)\s+[\d.]+ \w?i?B\s+(sent|local copy)", out)
    assert {int(t) for t, *_ in links} == {0, 1}
    # teacher 1 lives on ranks 4-7 only; the student spans 0-7: some of its rows cross
    assert any(t == "1" and int(d) < 4 for t, _, d, _ in links)
    assert "sent" in {k for *_, k in links} and "local copy" in {k for *_, k in links}
    # the prompts (8 tokens of each of 8 samples, 2 steps) are left out by the loss mask
    assert re.search(
        r"^  prompt tokens \(loss mask\) not sent: 128 tokens, [\d.]+ \w?i?B saved", out, re.M
    )


def test_demo_runs_with_no_progress_bar_off_a_terminal(eight_ranks) -> None:
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    assert "step/s" not in eight_ranks.stderr and "%|" not in eight_ranks.stderr
    assert "tqdm is not installed" not in eight_ranks.stderr  # no bar is skipped here


def test_parallel_job_matches_a_one_rank_run(eight_ranks, tmp_path: Path) -> None:
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    single = _run("--steps", "2", *SINGLE_RANK, MOPD_PHASE_DIR=str(tmp_path))
    assert single.returncode == 0, _explain(single)
    assert "verification: OK" in single.stdout
    from mopd.profiling import phases

    assert {r: p.phase for r, p in phases.read(tmp_path).items()} == {0: "done"}
    par, ref = _losses(eight_ranks.stdout), _losses(single.stdout)
    # step 1: same weights, same tokens, float32 reductions in another order
    assert par[0] == pytest.approx(ref[0], rel=1e-5), (par, ref)
    # step 2 also checks the gradient sync and the optimizer step (Adam amplifies tiny noise)
    assert par[1] == pytest.approx(ref[1], rel=1e-4), (par, ref)
    assert par[1] != pytest.approx(par[0], rel=1e-4)  # the step changed the student


def test_pipelined_job_with_the_default_loss_path_matches(eight_ranks) -> None:
    """Student and teacher PP=2 (1F1B / forward-only schedules), 4 micro-batches, megatron's
    default loss normalization: the same losses as the 8-rank PP=1 job, and the same JSON."""
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    argv = ["--steps", "2", "--student", "tp=2,cp=2,pp=2", "--teacher", "tp=2,pp=2"]
    argv += ["--teacher", "tp=4,rank_offset=4", "--micro-batches", "4", "--loss-path", "default"]
    proc = _run(*argv, "--json")
    assert proc.returncode == 0, _explain(proc)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["verification"]["ok"] and result["verification"]["rows"] > 0
    assert result["config"]["micro_batches"] == 4 and not result["config"]["per_token_loss"]
    assert set(result["phase_ms_max_over_ranks"]) == set(PHASES)
    assert result["bytes_sent"] > 0 and result["logits_bytes_instead"] > result["bytes_sent"]
    assert result["masked_tokens"] == 128 and result["bytes_saved_by_mask"] > 0
    ref = _losses(eight_ranks.stdout)
    got = result["loss_per_step"]
    assert got[0] == pytest.approx(ref[0], rel=1e-5), (got, ref)
    assert got[1] == pytest.approx(ref[1], rel=1e-4), (got, ref)


def test_injected_mismatch_fails_the_job() -> None:
    proc = _run("--steps", "1", "--inject-mismatch", *FOUR_RANKS)
    assert proc.returncode != 0, _explain(proc)
    assert "verification: MISMATCH" in proc.stdout, _explain(proc)
    assert "verification: OK" not in proc.stdout
    assert re.search(
        r"teacher 0 micro-batch 0: 1 of \d+ rows differ from the reference", proc.stderr
    ), _explain(proc)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--student", "tp=3"], "do not divide by tp=3"),
        (["--nproc", "4"], "needs global ranks"),
        (
            ["--teacher", "tp=2", "--teacher", "tp=2", "--student", "tp=2,cp=2"],
            "ranks [4, 5, 6, 7] hold none",
        ),
        (["--student", "tp=2,zz=1"], "unknown key 'zz'"),
        (["--teacher-hidden", "64"], "2 teacher meshes but 1 teacher hidden sizes"),
        (["--teacher", "tp=2,abc"], "'abc' is not KEY=VALUE"),
        (["--samples", "7"], "must divide into 2 micro-batches"),
        (["--samples", "6"], "must divide by the number of teachers"),
        (["--teacher-hidden", "64,abc"], "'abc' in '64,abc' is not an integer"),
        (["--student", "tp=2,pp=3"], "2 layers do not divide by pp=3"),
    ],
)
def test_bad_flags_are_rejected_before_launch(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() >= 8,
    reason="needs a machine with fewer than 8 GPUs (checks the refusal)",
)
def test_nccl_without_enough_gpus_is_refused(capsys) -> None:
    assert demo.main(["--backend", "nccl"]) == 2
    assert "--backend nccl needs 8 GPUs" in capsys.readouterr().err


def test_demo_takes_the_one_mesh_syntax(capsys) -> None:
    """``rank_offset=`` as in the API; the old ``at=`` is refused with what to write instead."""
    with pytest.raises(SystemExit) as exc:
        demo.main(["--student", "tp=2,at=4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at= is now rank_offset=" in err


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_on_a_terminal_the_bar_draws_and_no_line_lands_on_it() -> None:
    """stdout and stderr on one terminal (a pty, 120 columns), as a user sees the demo."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", TERM="xterm")
    env.pop("MOPD_NVTX", None)
    argv = [sys.executable, "-m", "mopd.profiling.demo", "--steps", "2", *SINGLE_RANK]
    proc = subprocess.Popen(
        [*argv, "--timeout", "220"], cwd=ROOT, env=env, stdout=slave, stderr=slave, close_fds=True
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=240) == 0
    text = _ANSI.sub("", b"".join(chunks).decode(errors="replace"))
    segments = [seg for line in text.split("\n") for seg in line.split("\r")]
    bars = [seg for seg in segments if "%|" in seg]
    assert any("2/2" in seg and "step" in seg for seg in bars), text[-3000:]  # it drew
    for seg in bars:  # a bar's line holds the bar alone: nothing printed after it
        assert seg.rstrip().endswith("]"), repr(seg)
    for line in ("verification: OK", "phase (ms, max over ranks)", "loss: "):
        hits = [seg for seg in segments if line in seg]
        assert hits and all(seg.lstrip().startswith(line) for seg in hits), (line, hits)


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--nproc", "8"), ("--steps", "3"), ("--student", "tp=2,cp=2,dp=2")]:
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", out), flag
    assert "1260 for 8 ranks, 3 steps" in out  # --timeout's default, scaled with the job
    assert "(default: None)" not in out and "(default: False)" not in out
