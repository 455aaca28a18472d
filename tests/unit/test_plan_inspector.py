"""Tier 1: ``mopd plan`` (profiling/plan/inspector.py) against figures derived apart from it.

Each case runs ``main()`` as a user would, reads the JSON and the printed summary, and checks
them against what this file derives on its own: expected token counts from plain arithmetic on
the batch (CP zigzag counted by hand), the matrix from the per-token oracle
(``tests/support/plan_oracle.py``) on the same step, and every destination row filled with the
right key by running the union of the rank plans with a mailbox (``tests/support/plan_sim.py``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mopd.profiling import cli
from mopd.profiling.plan import PlanReport, PlanRequest, inspect_plan, main
from tests.support.plan_oracle import oracle_plans
from tests.support.plan_sim import deliver, expected_slice, key_sources

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[str, dict[str, Any]]:
    out_json = tmp_path / "plan.json"
    rc = main([*argv, "--json", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out, json.loads(out_json.read_text())


def _dense(data: dict[str, Any]) -> np.ndarray:
    w = data["world_size"]
    m = np.zeros((w, w), dtype=np.int64)
    for i, j, b in data["matrix"]:
        assert m[i, j] == 0, "matrix entries listed twice"
        m[i, j] = b
    return m


def _zigzag_count(padded_len: int, real_len: int, cp: int, cp_rank: int) -> int:
    """Real tokens CP rank ``cp_rank`` holds of one sequence (chunks r and 2cp-1-r), by hand."""
    if cp == 1:
        return min(padded_len, real_len)
    chunk = padded_len // (2 * cp)
    n = 0
    for c in (cp_rank, 2 * cp - 1 - cp_rank):
        lo, hi = c * chunk, (c + 1) * chunk
        n += max(0, min(hi, real_len) - lo)
    return n


def _check_consistent(
    data: dict[str, Any], out: str, *, tokens: int, tokens_per_group: dict[str, int]
) -> np.ndarray:
    """Invariants every inspected step must satisfy; returns the dense matrix."""
    f = data["figures"]
    m = _dense(data)
    row = data["hidden_size"] * data["dtype_bytes"]
    assert data["tokens_per_student_group"] == tokens_per_group
    assert sum(tokens_per_group.values()) == tokens  # every token in exactly one student group
    # bytes across + local equal the minimum: each needed token once per student group, H x bytes
    assert int(m.sum()) == f["bytes_total"] == f["bytes_minimum"] == tokens * row
    diag = np.diagonal(m)
    send = m.sum(axis=1) - diag
    recv = m.sum(axis=0) - diag
    assert data["send_bytes"] == send.tolist()
    assert data["recv_bytes"] == recv.tolist()
    assert data["local_bytes"] == diag.tolist()
    assert f["bytes_cross"] == int(send.sum()) == int(recv.sum())
    assert f["bytes_local"] == int(diag.sum())
    assert np.sum(data["send_bytes_per_micro_batch"], axis=0).tolist() == send.tolist()
    # imbalance: max / mean over ranks that send (receive) anything
    for what, v in (("send", send), ("recv", recv)):
        nz = v[v > 0].astype(np.float64)
        want = float(nz.max() / nz.mean()) if nz.size else 0.0
        assert f[f"{what}_imbalance"] == pytest.approx(want, rel=1e-12)
    # time model: per micro-batch the slowest rank's max(send, recv) / link, added up
    gbps = f["link_gbps"]
    per_mb = np.maximum(data["send_bytes_per_micro_batch"], data["recv_bytes_per_micro_batch"])
    want_t = sum(int(v.max()) for v in per_mb) * 8 / (gbps * 1e9)
    assert f["time_cross_s"] == pytest.approx(want_t, rel=1e-12)
    # logits: vocab * bytes per token to every student rank that needs it
    tp_s = data["student"]["tp"]
    vb = data["vocab_size"] * data["dtype_bytes"]
    assert f["logits_full_bytes"] == tokens * tp_s * vb
    assert f["logits_sharded_bytes"] == tokens * vb
    assert f["logits_full_ratio"] == pytest.approx(tp_s * data["vocab_size"] / data["hidden_size"])
    # host path: every row leaves a teacher GPU once, and lands on each student rank needing it
    assert f["host_d2h_bytes"] == tokens * row == sum(data["host_d2h_bytes_per_rank"])
    h2d_copies = 1 if data["student"]["sp"] or tp_s == 1 else tp_s
    assert f["host_h2d_bytes"] == tokens * row * h2d_copies
    assert f["host_pcie_bytes"] == f["host_d2h_bytes"] + f["host_h2d_bytes"]
    # the printed summary carries the same totals
    printed = re.search(r"bytes: .* local copies \((\d+) B, = the minimum", out)
    assert printed is not None and int(printed.group(1)) == f["bytes_total"]
    assert f"imbalance max/mean {f['send_imbalance']:.4f}" in out
    return m


def _check_plans(report: PlanReport) -> None:
    """Independently of the inspector's arithmetic: the oracle's matrix is the report's, and the
    rank plans, run with a mailbox, put every wanted key in its row (each token crosses once)."""
    step, req = report.step, report.request
    rb = req.row_bytes
    w = report.world_size
    want = np.zeros((w, w), dtype=np.int64)
    for catalog in step.catalogs:
        for r, plan in oracle_plans(catalog, ranks=step.topology.members).items():
            for t in plan.sends:
                want[r, t.dst_rank] += t.count * rb
            for t in plan.locals:
                want[r, r] += t.count * rb
    assert np.array_equal(report.dense(), want)
    filled = 0
    for i, plans in enumerate(step.plans):
        sources = key_sources([req.teacher], [step.teacher_layouts[i]], step.topology.members)
        got = deliver(plans, sources)
        for r, plan in plans.items():
            if plan.dest is None:
                continue
            c = req.student.coord(r)
            assert c is not None
            key = r if req.keeps_sp_slice else (c.dp_rank, c.cp_rank)
            expect = expected_slice(plan, step.student_layouts[i][key], 0)
            assert np.array_equal(got[r][0], expect), (i, r)
            a = plan.dest.row_offset
            filled += int((plan.owner_N[a : a + plan.dest.slice_rows] >= 0).sum())
    # the slices of a group partition its rows: every wanted token crossed exactly once
    assert filled == report.figures["tokens_needed"] == req.num_tokens


def _request(**kw: Any) -> PlanRequest:
    from mopd.bridge import Mesh

    kw["teacher"] = Mesh(name="teacher", **kw.pop("teacher"))
    kw["student"] = Mesh(name="student", **kw.pop("student"))
    return PlanRequest(**kw)


# --- the README's example -------------------------------------------------------------------


def test_teacher_tp8_pp2_to_student_tp4_cp2_dp2_disjoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b, s, hidden = 4, 256, 512
    png = tmp_path / "m.png"
    out, data = _run(
        [
            "--teacher", "tp=8,pp=2,dp=1,cp=1",
            "--student", "tp=4,cp=2,dp=2",
            "--batch", str(b), "--seq-len", str(s),
            "--hidden-size", str(hidden), "--png", str(png),
        ],
        tmp_path,
        capsys,
    )  # fmt: skip
    groups = {f"dp{d}_cp{c}": (b // 2) * (s // 2) for d in range(2) for c in range(2)}
    m = _check_consistent(data, out, tokens=b * s, tokens_per_group=groups)
    assert data["student"]["rank_offset"] == 16  # right after the teacher's 16 ranks
    # only the teacher's last stage sends, only student ranks receive, nothing stays local
    senders = np.flatnonzero(m.sum(axis=1)).tolist()
    receivers = np.flatnonzero(m.sum(axis=0)).tolist()
    assert senders == list(range(8, 16)) and receivers == list(range(16, 32))
    assert data["figures"]["bytes_local"] == 0
    # every token is sent once, spread evenly over the 8 replicas (design: within 10%)
    assert data["figures"]["send_imbalance"] <= 1.1
    assert data["figures"]["replica_imbalance"] <= 1.1
    # the all-gather inside each student TP group: (tp-1) slices per rank
    slice_rows = (b // 2) * (s // 2) // 4
    assert data["student_allgather_bytes_per_rank"][16:32] == [3 * slice_rows * hidden * 2] * 16
    assert "picture:" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 400 and img.shape[1] > 400
    assert img.std() > 0.05  # more than a blank canvas


def test_full_size_example_stays_interactive() -> None:
    """The README's command at its real size: 16 x 8192 tokens, H=8192, 32 ranks."""
    req = _request(
        teacher={"tp": 8, "pp": 2},
        student={"tp": 4, "cp": 2, "dp": 2, "rank_offset": 16},
        lengths=(8192,) * 16,
        padded_seq_len=8192,
        hidden_size=8192,
        vocab_size=152064,
    )
    t0 = time.perf_counter()
    report = inspect_plan(req)
    elapsed = time.perf_counter() - t0
    f = report.figures
    assert f["bytes_cross"] == 16 * 8192 * 8192 * 2 == 2 * 2**30
    assert f["messages"] == 8 * 16  # each of 8 replicas serves a chunk of each of 16 slices
    assert report.send_W[8:16].tolist() == [256 * 2**20] * 8
    assert f["time_cross_s"] == pytest.approx(256 * 2**20 * 8 / 400e9)
    assert elapsed < 30, f"{elapsed:.1f} s for 131072 tokens on 32 ranks"  # ~1 s when idle


def test_realistic_example_at_128_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Teacher TP8 PP2 DP4 (64 GPUs) and student TP4 CP2 DP8 (64 GPUs): 16 nodes of 8."""
    b, s, hidden = 16, 128, 256
    out, data = _run(
        [
            "--teacher", "tp=8,pp=2,dp=4",
            "--student", "tp=4,cp=2,dp=8",
            "--batch", str(b), "--seq-len", str(s),
            "--hidden-size", str(hidden), "--no-png", "--top", "3",
        ],
        tmp_path,
        capsys,
    )  # fmt: skip
    assert data["world_size"] == 128
    groups = {f"dp{d}_cp{c}": (b // 8) * (s // 2) for d in range(8) for c in range(2)}
    m = _check_consistent(data, out, tokens=b * s, tokens_per_group=groups)
    assert np.flatnonzero(m.sum(axis=1)).tolist() == list(range(32, 64))  # last stage sends
    # student DP rank d holds samples of teacher DP rank d // 2: each of that group's 8
    # replicas serves a chunk of each of its 2 x 2 x 4 = 16 student slots, and nobody else's
    assert (m[32:64, 64:] > 0).sum(axis=1).tolist() == [16] * 32
    for t_dp in range(4):
        served = np.flatnonzero(m[32 + 8 * t_dp : 40 + 8 * t_dp].sum(axis=0)).tolist()
        assert served == list(range(64 + 16 * t_dp, 80 + 16 * t_dp))
    # big meshes print the top rows compactly, then a count of the rest
    assert "... 29 more source ranks" in out
    assert "transfer matrix" in out and "src\\dst" not in out
    assert not (tmp_path / "plan.png").exists() and not Path("plan.png").exists()


# --- placements, batch kinds, micro-batches -------------------------------------------------


def test_colocated_diagonal_is_local_copies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    b, s, hidden = 2, 64, 128
    out, data = _run(
        [
            "--teacher", "tp=4,pp=2", "--student", "tp=2,cp=2,dp=2", "--colocated",
            "--batch", str(b), "--seq-len", str(s), "--hidden-size", str(hidden), "--no-png",
        ],
        tmp_path,
        capsys,
    )  # fmt: skip
    groups = {f"dp{d}_cp{c}": (b // 2) * (s // 2) for d in range(2) for c in range(2)}
    m = _check_consistent(data, out, tokens=b * s, tokens_per_group=groups)
    # student ranks 4..7 are teacher replicas (last stage 4..7): served locally, receive nothing
    diag = np.diagonal(m)
    assert np.flatnonzero(diag).tolist() == [4, 5, 6, 7]
    assert data["recv_bytes"][4:8] == [0, 0, 0, 0]
    slice_bytes = (b // 2) * (s // 2) // 2 * hidden * 2
    assert diag[4:8].tolist() == [slice_bytes] * 4
    assert data["figures"]["local_copies"] == 4
    assert data["figures"]["bytes_cross"] == data["figures"]["bytes_local"]  # half and half
    assert "colocated" in out and "local copies: ranks 4-7" in out
    assert "src\\dst" in out  # a small mesh prints the dense matrix


def test_packed_cp_sp_micro_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = [37, 5, 64, 100, 1, 23, 70, 2, 9, 51, 13, 40]
    hidden = 96
    out, data = _run(
        [
            "--teacher", "tp=2,cp=2,dp=2,pp=2", "--student", "tp=2,cp=3,dp=3",
            "--packed-lengths", ",".join(map(str, lengths)), "--hidden-size", str(hidden),
            "--dtype-bytes", "4", "--sequence-parallel", "both", "--micro-batches", "2",
            "--no-png",
        ],
        tmp_path,
        capsys,
    )  # fmt: skip
    # micro-batch i: samples [6i, 6i+6); student dp rank d holds [6i+2d, 6i+2d+2), each sample
    # padded to a multiple of 2*cp*tp = 12 (SP), CP zigzag over 3 ranks
    groups = {}
    for d in range(3):
        for c in range(3):
            mine = [lengths[6 * i + 2 * d + k] for i in range(2) for k in range(2)]
            groups[f"dp{d}_cp{c}"] = sum(_zigzag_count(-(-n // 12) * 12, n, 3, c) for n in mine)
    _check_consistent(data, out, tokens=sum(lengths), tokens_per_group=groups)
    assert data["figures"]["student_allgather_bytes"] == 0  # the student keeps its SP slices
    assert data["figures"]["host_h2d_bytes"] == sum(lengths) * hidden * 4
    assert data["batch"]["micro_batches"] == 2 and data["figures"]["micro_batches"] == 2
    # the teacher's (dp=0, cp=0) buffer of micro-batch 0: samples 0-2 padded to 8 (2*cp*tp), /cp;
    # each of its TP ranks (last stage 8, 9) is a source of its own SP half of it
    full = sum(-(-n // 8) * 8 for n in lengths[:3]) // 2
    assert data["teacher_rows"]["rank8"][0] == data["teacher_rows"]["rank9"][0] == full // 2
    # every student rank is its own destination: rows of its own SP slice
    assert sorted(data["student_rows"]) == sorted(f"rank{r}" for r in range(16, 34))


def test_plans_deliver_every_token_once_and_match_the_oracle() -> None:
    """Padded SBH teacher, BSH student, 3 micro-batches, partial overlap of the meshes."""
    for student_sp in (False, True):
        req = _request(
            teacher={"tp": 2, "cp": 2, "dp": 1, "pp": 2},
            student={"tp": 2, "cp": 1, "dp": 3, "rank_offset": 4},
            lengths=(20,) * 6,
            padded_seq_len=20,
            hidden_size=16,
            vocab_size=100,
            micro_batches=2,
            student_sp=student_sp,
        )
        report = inspect_plan(req)
        _check_plans(report)
        f = report.figures
        assert f["bytes_total"] == f["bytes_minimum"] == 6 * 20 * 16 * 2
        # ranks 4..7 are both teacher last stage and student: some rows stay local
        assert f["bytes_local"] > 0 and f["bytes_cross"] > 0


def test_cli_dispatches_plan_help_and_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, md = tmp_path / "p.png", tmp_path / "p.md"
    argv = ["--teacher", "tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8"]
    assert cli.main(["plan", *argv, "--png", str(png), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert f"picture: {png}" in out and f"markdown: {md}" in out
    text = md.read_text()
    # 2 samples x 8 tokens x 4096 x 2 bytes, disjoint: all of it crosses
    assert "bytes: 128.00 KiB total = 128.00 KiB across ranks + 0 B local copies (131072 B" in text
    assert "## Environment" in text and "![transfer matrix](p.png)" in text
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--packed-lengths" in help_text and "rank_offset=16" in help_text


def test_json_to_stdout_replaces_the_text(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--teacher", "tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8"]
    assert main([*argv, "--no-png", "--json", "-"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)  # nothing but the JSON on stdout
    assert data["figures"]["bytes_total"] == 2 * 8 * 4096 * 2


def test_ignored_settings_warn() -> None:
    base = ["--teacher", "tp=2", "--batch", "2", "--seq-len", "8", "--no-png"]
    with pytest.warns(UserWarning, match="student sequence parallelism ignored: student tp=1"):
        assert main([*base, "--student", "tp=1", "--sequence-parallel", "student"]) == 0
    with pytest.warns(UserWarning, match="--nvlink-gbps 100 ignored: the student does no TP"):
        assert main([*base, "--student", "tp=1", "--nvlink-gbps", "100"]) == 0


# --- bad input ----------------------------------------------------------------------------


_OK = ["--student", "tp=2", "--batch", "2", "--seq-len", "8"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--teacher", "tp=8,zz=2", *_OK], "unknown key 'zz'"),
        (["--teacher", "tp=8,tp=2", *_OK], "tp= given twice"),
        (["--teacher", "tp=0", *_OK], "tp=0 must be >= 1"),
        (["--teacher", "tp=x", *_OK], "tp='x' is not an integer"),
        (["--teacher", "tp=2,abc", *_OK], "'abc' is not KEY=VALUE"),
        (["--teacher", "tp=2,offset=4", *_OK], "offset= is now rank_offset="),
        (["--teacher", "tp=8", "--student", "tp=2"], "one of the arguments --batch --packed-lengths"),
        (["--teacher", "tp=8", "--student", "tp=2", "--batch", "2"], "--batch needs --seq-len"),
        (["--teacher", "tp=8", "--student", "tp=2", "--packed-lengths", "3,4", "--seq-len", "8"],
         "--seq-len applies to padded batches"),
        (["--teacher", "tp=8,pp=2", "--student", "tp=4,dp=2", "--colocated", "--batch", "2",
          "--seq-len", "8"], "teacher 16 ranks and student 8"),
        (["--teacher", "tp=2", "--student", "tp=2,rank_offset=2", "--colocated", "--batch", "2",
          "--seq-len", "8"], "drop rank_offset= from ['student']"),
        (["--teacher", "tp=2", "--student", "tp=2,dp=3", "--batch", "4", "--seq-len", "8"],
         "a micro-batch of 4 samples (4 samples / 1 micro-batches) does not split over the "
         "student's dp=3"),
        (["--teacher", "tp=2", "--student", "tp=2", "--batch", "4", "--seq-len", "8",
          "--micro-batches", "3"], "--micro-batches 3 does not divide the batch of 4 samples"),
        (["--teacher", "tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8",
          "--link-gbps", "0"], "0.0 must be > 0"),
        (["--teacher", "tp=2", "--student", "tp=2", "--packed-lengths", "3,0"],
         "length 0 in '3,0' must be >= 1"),
        (["--teacher", "tp=2", "--student", "tp=2", "--packed-lengths", "3,x"],
         "length 'x' in '3,x' is not an integer"),
        (["--teacher", "tp=2", *_OK, "--json", "/nonexistent/dir/x.json"],
         "folder /nonexistent/dir does not exist"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "never.png"
    assert main([*argv, "--png", str(png)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert captured.err.count("\n") == 1, captured.err  # one line, no usage block
    assert captured.err.startswith("mopd plan: error: ")
    assert captured.out == ""
    assert not png.exists()


def test_png_in_a_missing_folder_is_refused_not_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "x.png"
    assert main(["--teacher", "tp=2", *_OK, "--png", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"--png: {target}: folder {target.parent} does not exist" in err
    assert not (tmp_path / "no").exists()


# --- sources from the teacher's SP shards ---------------------------------------------------

SHARD_CASES = {
    # name: (teacher mesh, student mesh, batch keywords, student keeps its SP slice)
    "padded tp4-dp2 -> tp2-cp2-dp2 colocated": (
        {"tp": 4, "dp": 2},
        {"tp": 2, "cp": 2, "dp": 2},
        {"lengths": (24,) * 8, "padded_seq_len": 24},
        False,
    ),
    "packed tp2-cp2-dp2-pp2 -> tp2-cp3-dp3 sp, disjoint": (
        {"tp": 2, "cp": 2, "dp": 2, "pp": 2},
        {"tp": 2, "cp": 3, "dp": 3, "rank_offset": 16},
        {"lengths": (37, 5, 64, 100, 1, 23, 70, 2, 9, 51, 13, 40), "padded_seq_len": None},
        True,
    ),
    "padded tp2-pp2 -> tp2-dp3, partial overlap": (
        {"tp": 2, "cp": 1, "pp": 2},
        {"tp": 2, "dp": 3, "rank_offset": 2},
        {"lengths": (20,) * 6, "padded_seq_len": 20},
        False,
    ),
}


@pytest.mark.parametrize("case", sorted(SHARD_CASES))
def test_sources_from_sp_shards_send_every_row_once_and_gather_nothing(case: str) -> None:
    """Teacher SP with each TP rank its own source: the sources are the SP shards (one rank,
    its own ``1/tp`` of the buffer, no key held twice: ``check_rank`` passes on every rank),
    the plans deliver every wanted row once, and nothing crosses the teacher's TP links. The
    replica path on the same step pays ``tp - 1`` shards per teacher rank there instead."""
    t_kw, s_kw, batch, s_sp = SHARD_CASES[case]
    common: dict[str, Any] = {
        "teacher": t_kw,
        "student": s_kw,
        "hidden_size": 8,
        "vocab_size": 50,
        "micro_batches": 2,
        "teacher_sp": True,
        "student_sp": s_sp,
        **batch,
    }
    shards = inspect_plan(_request(**common))
    replicas = inspect_plan(_request(**common, teacher_sp_shards=False))
    req, step = shards.request, shards.step
    t, rb = req.teacher, req.row_bytes
    assert req.sources_from_shards and not replicas.request.sources_from_shards
    # the sources: every last-stage teacher rank alone, in TP order within each (dp, cp) shard
    want = [(r,) for d, c in t.shards() for r in t.tp_group_ranks(dp_rank=d, cp_rank=c)]
    assert [g.ranks for g in step.topology.sources] == want
    assert step.topology.shard_sources == (True,)
    # each holds its own SP slice: 1/tp of the replica buffer, and the slices tile it
    for i, held in enumerate(replicas.step.teacher_layouts):
        for (d, c), full in held.items():
            parts = [step.teacher_layouts[i][r] for r in t.tp_group_ranks(dp_rank=d, cp_rank=c)]
            assert [p.num_rows for p in parts] == [full.num_rows // t.tp] * t.tp
            assert torch.equal(torch.cat([p.sample_id_R for p in parts]), full.sample_id_R)
            assert torch.equal(torch.cat([p.position_R for p in parts]), full.position_R)
    _check_plans(shards)  # every wanted key lands in its row, each token crosses once
    _check_plans(replicas)
    f, g = shards.figures, replicas.figures
    assert f["bytes_total"] == f["bytes_minimum"] == g["bytes_total"] == req.num_tokens * rb
    assert f["link_bytes"]["teacher_tp"] == 0 and f["links_at_minimum"]
    assert not shards.teacher_gather_MW.any()
    full_rows = sum(lay.num_rows for held in replicas.step.teacher_layouts for lay in held.values())
    assert g["link_bytes"]["teacher_tp"] == (t.tp - 1) * full_rows * rb
    assert g["link_bytes_total"] - f["link_bytes_total"] == g["link_bytes"]["teacher_tp"] + (
        g["link_bytes"]["student_tp"] - f["link_bytes"]["student_tp"]
    )
    assert not g["links_at_minimum"]


def _links(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    out, data = _run([*argv, "--no-png"], tmp_path, capsys)
    f = data["figures"]
    row = data["hidden_size"] * data["dtype_bytes"]
    links, floor = f["link_bytes"], f["link_bytes_minimum"]
    assert set(links) == {"cross", "local", "teacher_tp", "student_tp"}
    assert links["cross"] == f["bytes_cross"] and links["local"] == f["bytes_local"]
    assert links["student_tp"] == f["student_allgather_bytes"]
    assert floor["cross_plus_local"] == f["tokens_needed"] * row
    assert f["link_bytes_total"] == sum(links.values())
    assert f["link_bytes_total_minimum"] == sum(floor.values())
    assert data["sources_from_shards"] == f["sources_from_shards"]
    assert data["teacher"]["sp_shards"] == f["sources_from_shards"]
    assert sum(data["teacher_tp_gather_bytes_per_rank"]) == links["teacher_tp"]
    assert "== bytes per link class, per step (beside the minimum) ==" in out
    assert ("\nat the minimum\n" in out) == f["links_at_minimum"]
    return f


def test_link_classes_of_the_readme_example_at_the_minimum(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's ``mopd plan`` meshes (smaller batch): at the minimum without teacher SP and
    with it (sources from the SP shards); the replica path is above it by the SP gather."""
    base = [
        "--teacher", "tp=8,pp=2", "--student", "tp=4,cp=2,dp=2",
        "--batch", "4", "--seq-len", "256", "--hidden-size", "512",
    ]  # fmt: skip
    plain = _links(base, tmp_path, capsys)
    assert plain["links_at_minimum"] and not plain["sources_from_shards"]
    sp = _links([*base, "--sequence-parallel", "teacher"], tmp_path, capsys)
    assert sp["links_at_minimum"] and sp["sources_from_shards"]
    assert sp["link_bytes"] == plain["link_bytes"]
    old = _links(
        [*base, "--sequence-parallel", "teacher", "--teacher-sp-replicas"], tmp_path, capsys
    )
    assert not old["links_at_minimum"] and not old["sources_from_shards"]
    # the gather: each of the 8 last-stage ranks receives 7/8 of the 4 x 256 rows
    assert old["link_bytes"]["teacher_tp"] == 8 * (4 * 256 // 8) * 7 * 512 * 2
    assert old["link_bytes_total"] == plain["link_bytes_total"] + old["link_bytes"]["teacher_tp"]


@pytest.mark.parametrize("teacher", ["tp=2,dp=2", "tp=4,rank_offset=4"])
def test_link_classes_of_the_demo_meshes_at_the_minimum(
    teacher: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's meshes, one teacher at a time with its share of a step (its teachers run
    SP): student TP2 CP2 DP2 on all 8 ranks, THD, 2 micro-batches, sources from SP shards."""
    argv = [
        "--teacher", teacher, "--student", "tp=2,cp=2,dp=2,rank_offset=0",
        "--packed-lengths", "17,32,9,25", "--micro-batches", "2", "--hidden-size", "64",
        "--sequence-parallel", "teacher",
    ]  # fmt: skip
    f = _links(argv, tmp_path, capsys)
    assert f["links_at_minimum"] and f["sources_from_shards"]
    assert f["link_bytes"]["teacher_tp"] == 0 and f["link_bytes"]["student_tp"] > 0
