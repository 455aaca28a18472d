"""``mopd demo``: the multi-teacher on-policy MOPD job, run for real as a subprocess (it starts
torchrun).

What can fail here: the job's exit code, its step-1 verification (bridged rows against an
all-gather reference), the final tables (time per phase, rollout and held-out KL per step) and
the trend lines, its last line (the verdict, agreeing with the table), the results JSON and the
loss-curve PNG it writes, a line per step in a log, its ``--json`` form (``"rollouts":
"student"``, a held-out KL list per teacher), the detection of a corrupted bridge buffer (a hidden
``--inject-mismatch`` flag must make the job exit non-zero, with a FAILED verdict; run on the
4-rank preset), and whether the student gets closer to its teachers: with the default settings
(a one-rank run of them), the held-out KL of every teacher ends at most 0.9x where it started.

Independence of the parallelism: every weight is drawn from its full name's seed, and a sample's
tokens from noise keyed by its id (:mod:`mopd.profiling.demo.sampling`), so the 8-rank job (student
TP2 CP2 DP2, teachers TP2 DP2 and TP4), a one-rank job and a pipelined job (student and teacher
PP=2, 4 micro-batches, megatron's default loss path) sample the same rollouts wherever their
logits agree up to float reordering. Compared: the first two steps (step 1 from the same weights,
step 2 after one Adam step), their rollouts exactly (a digest of every token id) and their KLs
to float tolerance; later steps are not compared, since a reordering-sized difference can flip a
near-tied token there and every later step then differs. The job hands its rollouts to the
library (``Distiller.step(rollouts, num_micro_batches=M)`` builds every micro-batch), so counts
that split unevenly over micro-batches, DP ranks and teachers run and verify too. Also: bad
flags are rejected before anything starts, in one line leading with the failing flag and value
and naming the fix; the presets set the meshes and flags given win; ``--help`` shows the defaults; every rank records
the phases it goes through (its last one: ``done``); on a terminal the progress bar draws and no
printed line lands on the bar's line, and off one there is no bar at all.
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
import tempfile
import termios
from pathlib import Path
from typing import Any

import pytest
import torch

from mopd.profiling.demo import run as demo

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("held-out", "sample", "exchange+plan", "teacher fwd", "student fwd+bwd", "finish")
PHASES += ("optimizer",)
SINGLE_RANK = ["--nproc", "1", "--teacher", "tp=1", "--teacher", "tp=1", "--student", "tp=1"]
DEFAULTS = demo._parse([])[1]  # the settings of a plain `mopd demo`


#: Where the demo runs of this module record (not the checkout's mopd-results/).
RESULTS = Path(tempfile.mkdtemp(prefix="mopd-demo-tests-"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: the demo's last line when it worked
VERDICT = re.compile(
    r"^mopd demo: OK - rows exact, student (learned|did not learn): held-out KL "
    r"([\d.]+)x / ([\d.]+)x$"
)


def _run(
    *args: str, timeout: float = 300, results: Path = RESULTS, **env_extra: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
    env.pop("MOPD_NVTX", None)
    argv = [*args, "--results-dir", str(results), "--timeout", str(timeout - 20)]
    return subprocess.run(
        [sys.executable, "-m", "mopd.profiling.demo", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(stdout: str, first_head: str) -> list[list[float]]:
    """The rows of the text table whose header starts with ``step  <first_head>``."""
    lines = stdout.splitlines()
    at = next(i for i, x in enumerate(lines) if re.match(rf"^\s+step\s+{re.escape(first_head)}", x))
    rows = []
    for line in lines[at + 2 :]:
        if not re.match(r"^\s+\d+\s", line):
            break
        rows.append([float(v) for v in line.split()])
    return rows


def _rises(values: list[float]) -> list[int]:
    return [k + 1 for k in range(1, len(values)) if values[k] > values[k - 1]]


def _says_what_happened(line: str, values: list[float]) -> None:
    """A trend line names first -> last, the ratio and every step at which the series rose."""
    assert "decreasing" not in line
    m = re.match(r"^([\d.]+) -> ([\d.]+) \(([\d.]+)x\), (.*)$", line)
    assert m, line
    assert float(m[1]) == pytest.approx(values[0], abs=6e-5)
    assert float(m[2]) == pytest.approx(values[-1], abs=6e-5)
    assert float(m[3]) == pytest.approx(values[-1] / values[0], abs=6e-3)
    rises = _rises(values)
    if rises:
        assert m[4] == f"rose at step{'s' if len(rises) > 1 else ''} {', '.join(map(str, rises))}"
    else:
        assert m[4] == "fell every step"


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def eight_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eight")


@pytest.fixture(scope="module")
def eight_ranks(eight_results: Path) -> subprocess.CompletedProcess[str]:
    return _run("--steps", "2", "--links", results=eight_results)


@pytest.fixture(scope="module")
def one_rank_phases(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the one-rank default run's rank records its phases."""
    return tmp_path_factory.mktemp("phases")


@pytest.fixture(scope="module")
def one_rank_default(one_rank_phases: Path) -> subprocess.CompletedProcess[str]:
    """The default settings (steps, sizes, lr, temperature...) on one rank, as JSON."""
    return _run("--json", *SINGLE_RANK, MOPD_PHASE_DIR=str(one_rank_phases))


def test_demo_runs_verifies_and_prints_the_table(eight_ranks) -> None:
    out = eight_ranks.stdout
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    assert re.search(
        r"^verification: OK \(step 1: \d+ bridged rows on 8 student ranks, 2 micro-batches",
        out,
        re.M,
    )
    assert "student Mesh(tp=2, cp=2, dp=2" in out and "teacher1 Mesh(tp=4" in out
    times = _table(out, "held-out  sample")
    assert [r[0] for r in times] == [1, 2], times
    for r in times:  # step, one column per phase, total
        assert len(r) == len(PHASES) + 2 and all(t >= 0 and math.isfinite(t) for t in r), r
        assert r[-1] == pytest.approx(sum(r[1:-1]), abs=0.1 * len(PHASES))
    kl = _table(out, "rollout KL (the loss)")
    assert [r[0] for r in kl] == [1, 2], kl
    for r in kl:  # step, rollout KL (all), per teacher, held-out per teacher
        assert len(r) == 6 and all(math.isfinite(v) and v > 0 for v in r[1:]), r
    rollouts = re.search(
        r"^  rollouts: 32 responses sampled by the student, (\d+)\.\.(\d+) tokens", out, re.M
    )
    assert rollouts and 1 <= int(rollouts[1]) <= int(rollouts[2]) <= DEFAULTS.max_new_tokens
    links = re.findall(r"teacher(\d) r(\d) -> r(\d)\s+[\d.]+ \w?i?B\s+(sent|local copy)", out)
    assert {int(t) for t, *_ in links} == {0, 1}
    # teacher 1 lives on ranks 4-7 only; the student spans 0-7: some of its rows cross
    assert any(t == "1" and int(d) < 4 for t, _, d, _ in links)
    assert "sent" in {k for *_, k in links} and "local copy" in {k for *_, k in links}
    # the prompts (8 tokens of each of 16 samples, 2 steps) are left out by the response mask
    assert re.search(
        r"^  prompt tokens \(loss mask\) not sent: 256 tokens, [\d.]+ \w?i?B saved", out, re.M
    )
    trend = re.search(r"^  rollout KL: (.*)$", out, re.M)
    assert trend, out
    _says_what_happened(trend[1], [r[1] for r in kl])
    for k in range(2):
        trend = re.search(rf"^  held-out KL teacher {k}: (.*)$", out, re.M)
        assert trend, out
        _says_what_happened(trend[1], [r[4 + k] for r in kl])


def test_demo_ends_in_its_verdict_and_writes_its_results_and_curves(
    eight_ranks, eight_results: Path
) -> None:
    """The last line is the verdict, agreeing with the KL table; the results JSON and a PNG of
    the loss curves are written where --results-dir says, and named before the verdict."""
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    lines = eight_ranks.stdout.rstrip("\n").splitlines()
    m = VERDICT.match(lines[-1])
    assert m, lines[-3:]
    kl = _table(eight_ranks.stdout, "rollout KL (the loss)")
    for k in range(2):  # held-out KL of teacher k: last over first
        assert float(m[2 + k]) == pytest.approx(kl[-1][4 + k] / kl[0][4 + k], abs=6e-3)
    learned = all(kl[-1][4 + k] < kl[0][4 + k] for k in range(2))
    assert (m[1] == "learned") == learned
    (json_path,) = eight_results.glob("demo-*.json")
    (png,) = eight_results.glob("demo-*.png")
    assert json_path.with_suffix(".png") == png and png.read_bytes().startswith(PNG_MAGIC)
    import matplotlib.image

    assert matplotlib.image.imread(png).std() > 0.05  # more than a blank canvas
    data = json.loads(json_path.read_text())
    assert data["verification"]["ok"] and len(data["heldout_kl"][0]) == 2
    assert data["environment"]["torch"] and data["config"]["nproc"] == 8
    assert lines[-2] == f"  results: {json_path} and its loss curves {png.name}"


def test_a_log_gets_a_line_per_step(eight_ranks) -> None:
    """Off a terminal (no bar), every step says it finished, with its KLs and time."""
    steps = re.findall(
        r"^  step (\d)/2: rollout KL [\d.]+, held-out KL [\d.]+ / [\d.]+ \([\d.]+ s\)$",
        eight_ranks.stdout,
        re.M,
    )
    assert steps == ["1", "2"], eight_ranks.stdout[-3000:]


def test_demo_runs_with_no_progress_bar_off_a_terminal(eight_ranks) -> None:
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    assert "step/s" not in eight_ranks.stderr and "%|" not in eight_ranks.stderr
    assert "tqdm is not installed" not in eight_ranks.stderr  # no bar is skipped here


def test_the_student_approaches_its_teachers(one_rank_default, one_rank_phases) -> None:
    """The default run, on one rank: rollouts from the student, and each teacher's held-out KL
    (a fixed set, scored before every step) ends at most 0.9x where it began (recorded at
    0.60x and 0.68x; the issue's goal is 0.8x)."""
    proc = one_rank_default
    assert proc.returncode == 0, _explain(proc)
    result = _json(proc)
    assert result["rollouts"] == "student"
    assert result["verification"]["ok"]
    steps = result["config"]["steps"]
    assert steps == DEFAULTS.steps >= 8
    heldout = result["heldout_kl"]
    assert len(heldout) == 2 and all(len(h) == steps for h in heldout), heldout
    for k, h in enumerate(heldout):
        assert all(math.isfinite(v) and v > 0 for v in h), h
        assert h[-1] <= 0.9 * h[0], f"teacher {k}: held-out KL {h[0]:.4f} -> {h[-1]:.4f}"
        _says_what_happened(result["trends"]["heldout_kl"][k], h)
    _says_what_happened(result["trends"]["rollout_kl"], result["loss_per_step"])
    rollout_kl = result["rollout_kl"]
    assert len(rollout_kl) == 2 and all(len(r) == steps for r in rollout_kl)
    # under --json the verdict ends stderr (stdout is the JSON alone)
    m = VERDICT.match(proc.stderr.rstrip("\n").splitlines()[-1])
    assert m and m[1] == "learned", proc.stderr[-2000:]
    assert [float(m[2]), float(m[3])] == pytest.approx([h[-1] / h[0] for h in heldout], abs=6e-3)
    lengths = result["response_lengths"]
    assert len(lengths) == steps and all(len(x) == DEFAULTS.samples for x in lengths)
    assert all(1 <= n <= DEFAULTS.max_new_tokens for x in lengths for n in x)
    assert len(set(result["rollout_digest"])) == steps  # fresh rollouts every step
    from mopd.profiling import phases

    assert {r: p.phase for r, p in phases.read(one_rank_phases).items()} == {0: "done"}


def test_parallel_job_matches_a_one_rank_run(eight_ranks, one_rank_default) -> None:
    assert eight_ranks.returncode == 0, _explain(eight_ranks)
    assert one_rank_default.returncode == 0, _explain(one_rank_default)
    par = _table(eight_ranks.stdout, "rollout KL (the loss)")
    ref = _json(one_rank_default)
    for s in range(2):  # step 1: same weights; step 2: after one Adam step (it amplifies noise)
        rel = 1e-5 if s == 0 else 1e-4
        want = [ref["loss_per_step"][s]]
        want += [ref["rollout_kl"][k][s] for k in range(2)]
        want += [ref["heldout_kl"][k][s] for k in range(2)]
        # printed with 6 decimals; the rollouts differ if any sampled token does
        assert par[s][1:] == pytest.approx(want, rel=rel, abs=1e-6), (s, par[s], want)
    assert par[1][1] != pytest.approx(par[0][1], rel=1e-4)  # the step changed the student


def test_pipelined_job_with_the_default_loss_path_matches(one_rank_default) -> None:
    """Student and teacher PP=2 (the sampler through megatron's forward-only schedule, 1F1B
    training), 4 micro-batches, megatron's default loss normalization: the same rollouts, token
    for token, and the same KLs as the one-rank run."""
    assert one_rank_default.returncode == 0, _explain(one_rank_default)
    argv = ["--steps", "2", "--student", "tp=2,cp=2,pp=2", "--teacher", "tp=2,pp=2"]
    argv += ["--teacher", "tp=4,rank_offset=4", "--micro-batches", "4", "--loss-path", "default"]
    proc = _run(*argv, "--json")
    assert proc.returncode == 0, _explain(proc)
    result = _json(proc)
    assert result["rollouts"] == "student"
    assert result["verification"]["ok"] and result["verification"]["rows"] > 0
    assert result["config"]["micro_batches"] == 4 and not result["config"]["per_token_loss"]
    assert set(result["phase_ms_max_over_ranks"]) == set(PHASES)
    assert result["bytes_sent"] > 0 and result["logits_bytes_instead"] > result["bytes_sent"]
    assert result["masked_tokens"] == 256 and result["bytes_saved_by_mask"] > 0
    ref = _json(one_rank_default)
    assert result["heldout_digest"] == ref["heldout_digest"]
    assert result["rollout_digest"] == ref["rollout_digest"][:2]
    got, want = result["loss_per_step"], ref["loss_per_step"]
    assert got[0] == pytest.approx(want[0], rel=1e-5), (got, want)
    assert got[1] == pytest.approx(want[1], rel=1e-4), (got, want)
    for k in range(2):
        assert result["heldout_kl"][k] == pytest.approx(ref["heldout_kl"][k][:2], rel=1e-4)


def test_uneven_shares_run_and_verify() -> None:
    """Counts that split unevenly (5 prompts, 3 held-out, 2 micro-batches; student CP2 DP2,
    teacher 0 DP2): ``Distiller.step`` gives a DP rank or teacher with no sample in a
    micro-batch a placeholder, and the step still verifies bit-exact."""
    argv = ["--nproc", "4", "--teacher", "dp=2", "--teacher", "tp=2,rank_offset=2"]
    argv += ["--student", "cp=2,dp=2", "--samples", "5", "--heldout-samples", "3", "--steps", "1"]
    proc = _run(*argv, "--json")
    assert proc.returncode == 0, _explain(proc)
    result = _json(proc)
    assert result["verification"]["ok"] and result["verification"]["rows"] > 0
    assert [len(x) for x in result["response_lengths"]] == [5]
    assert result["masked_tokens"] == 5 * DEFAULTS.prompt_len
    for k in range(2):
        assert len(result["heldout_kl"][k]) == 1 and result["heldout_kl"][k][0] > 0


def test_injected_mismatch_fails_the_job() -> None:
    """On the 4-rank preset: a corrupted bridged row fails the job, named, in its verdict."""
    proc = _run("--steps", "1", "--inject-mismatch", "--preset", "4")
    assert proc.returncode != 0, _explain(proc)
    assert proc.stdout.startswith("mopd demo: 4 ranks"), _explain(proc)
    assert "verification: MISMATCH" in proc.stdout, _explain(proc)
    assert "verification: OK" not in proc.stdout
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    assert last == "mopd demo: FAILED - bridged rows differ from the all-gather reference on 1 rank"
    assert re.search(
        r"teacher 0 micro-batch 0: 1 of \d+ rows differ from the reference", proc.stderr
    ), _explain(proc)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--teacher", "tp=3"],
            "--teacher tp=3: 4 attention heads do not divide by tp=3; use a tp that divides "
            "--heads 4 (1, 2, 4), or --heads a multiple of 3",
        ),
        (["--student", "tp=3"], "--student tp=3: 4 attention heads do not divide by tp=3"),
        (["--lr", "-1"], "error: --lr -1: must be > 0 (see"),
        (["--nproc", "4"], "--teacher tp=4,rank_offset=4: needs global ranks 4..7"),
        (
            ["--teacher", "tp=2", "--teacher", "tp=2", "--student", "tp=2,cp=2"],
            "--nproc 8: ranks [4, 5, 6, 7] hold no model",
        ),
        (["--student", "tp=2,zz=1"], "unknown key 'zz'"),
        (["--teacher-hidden", "64"], "--teacher-hidden 64: 1 hidden sizes for 2 teacher meshes"),
        (["--teacher", "tp=2,abc"], "'abc' is not KEY=VALUE"),
        (["--samples", "1"], "--samples 1: must be at least 2, one per micro-batch"),
        (["--micro-batches", "3", "--samples", "2"], "--samples 2: must be at least 3"),
        (["--teacher-hidden", "64,abc"], "'abc' in '64,abc' is not an integer"),
        (["--student", "tp=2,pp=3"], "--layers 2: 2 layers do not divide by pp=3"),
        (["--temperature", "0"], "--temperature 0: must be > 0"),
        (["--prompt-len", "0"], "--prompt-len 0: must be in [1, 32)"),
        (["--heldout-samples", "1"], "--heldout-samples 1: must be at least 2"),
        (
            ["--teacher", "tp=2,dp=2", "--teacher", "tp=2,rank_offset=4", "--seq-len", "34"],
            "--seq-len 34: must divide by 2 * cp = 4",
        ),
        (["--preset", "3"], "invalid choice: 3 (choose from 4, 8)"),
    ],
)
def test_bad_flags_are_rejected_before_launch(argv, message, capsys) -> None:
    """One line, leading with the failing flag and value, then the rule and the fix."""
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_presets_set_the_meshes_and_flags_given_win() -> None:
    _, cfg = demo._parse(["--preset", "4"])
    assert cfg.nproc == 4 and [str(t) for t in cfg.teachers] == [
        "tp=2,pp=1,cp=1,dp=1,rank_offset=0",
        "tp=2,pp=1,cp=1,dp=1,rank_offset=2",
    ]
    assert str(cfg.student) == "tp=2,pp=1,cp=2,dp=1,rank_offset=0"
    assert cfg.teacher_hidden == (64, 96)
    assert demo._parse(["--preset", "8"])[1] == DEFAULTS  # the default run
    _, cfg = demo._parse(["--preset", "4", "--student", "tp=4"])
    assert str(cfg.student) == "tp=4,pp=1,cp=1,dp=1,rank_offset=0" and cfg.nproc == 4
    _, cfg = demo._parse(["--teacher", "tp=4", "--nproc", "4", "--student", "tp=4"])
    assert cfg.teacher_hidden == (64,)  # one teacher, one default hidden size


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
    argv += ["--results-dir", str(RESULTS / "terminal")]
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
    for line in ("verification: OK", "time per phase (ms, max over ranks)", "rollout KL: "):
        hits = [seg for seg in segments if line in seg]
        assert hits and all(seg.lstrip().startswith(line) for seg in hits), (line, hits)
    assert VERDICT.match([seg for seg in segments if seg.strip()][-1].rstrip()), text[-2000:]
    assert not re.search(r"^  step \d/2: rollout KL", text, re.M)  # the bar says it there


def test_help_shows_the_defaults(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--nproc", "8"), ("--steps", "16"), ("--student", "tp=2,cp=2,dp=2")]:
        assert re.search(rf"{flag} \S+ .*?\(default: {re.escape(default)}\)", out), flag
    assert "2040 for 8 ranks, 16 steps" in out  # --timeout's default, scaled with the job
    assert "(default: None)" not in out and "(default: False)" not in out
