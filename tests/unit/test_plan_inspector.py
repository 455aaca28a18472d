"""Tier 1: ``mopd plan`` (profiling/plan_inspector.py) against the planner's own counts.

Each case runs ``main()`` as a user would, reads the JSON and the printed summary, and checks
them against figures this file derives on its own: the layouts are rebuilt here from the bridge's
layout functions, planned with ``plan_token_exchange``, and the expected token counts come from
plain arithmetic on the batch (CP zigzag counted by hand), not from the inspector.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mopd.bridge import (
    Mesh,
    StudentBatch,
    TeacherBatch,
    concat_layouts,
    packed_layout,
    padded_layout,
    plan_token_exchange,
)
from mopd.profiling import cli
from mopd.profiling.plan_inspector import main, parse_mesh

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[str, dict[str, Any]]:
    out_json = tmp_path / "plan.json"
    rc = main([*argv, "--json", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return captured.out, json.loads(out_json.read_text())


def _dense(data: dict[str, Any]) -> torch.Tensor:
    w = data["world_size"]
    m = torch.zeros((w, w), dtype=torch.int64)
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
) -> torch.Tensor:
    """Invariants every inspected plan must satisfy; returns the dense matrix."""
    f = data["figures"]
    m = _dense(data)
    row = data["hidden_size"] * data["dtype_bytes"]
    assert data["tokens_per_student_group"] == tokens_per_group
    assert sum(tokens_per_group.values()) == tokens  # every token in exactly one student group
    # the matrix holds each needed token once per student (dp, cp) group, times H times bytes
    assert int(m.sum()) == f["bytes_total"] == tokens * row
    diag = torch.diagonal(m)
    send = m.sum(dim=1) - diag
    recv = m.sum(dim=0) - diag
    assert data["send_bytes"] == send.tolist()
    assert data["recv_bytes"] == recv.tolist()
    assert data["local_bytes"] == diag.tolist()
    assert f["bytes_cross"] == int(send.sum()) == int(recv.sum())
    assert f["bytes_local"] == int(diag.sum())
    assert data["plan_summary"]["bytes_cross"] == f["bytes_cross"]
    assert data["plan_summary"]["bytes_local"] == f["bytes_local"]
    # imbalance: max / mean over ranks that send (receive) anything
    for what, v in (("send", send), ("recv", recv)):
        nz = v[v > 0].double()
        want = float(nz.max() / nz.mean()) if nz.numel() else 0.0
        assert f[f"{what}_imbalance"] == pytest.approx(want, rel=1e-12)
    # time model: per rank max(send, recv) / link, step = max over ranks
    gbps = f["link_gbps"]
    want_t = (
        max(max(a, b) for a, b in zip(send.tolist(), recv.tolist(), strict=True)) * 8 / (gbps * 1e9)
    )
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
    printed = re.search(r"bytes: .* local copies \((\d+) B\)", out)
    assert printed is not None and int(printed.group(1)) == f["bytes_total"]
    assert f"imbalance max/mean {f['send_imbalance']:.4f}" in out
    return m


def _padded_plan(teacher: Mesh, student: Mesh, b: int, s: int, hidden: int) -> torch.Tensor:
    """The planner's own matrix for a padded batch, layouts built here (contiguous DP blocks)."""

    def layouts(mesh: Mesh) -> dict[tuple[int, int], Any]:
        per = b // mesh.dp
        return {
            (d, c): padded_layout(
                list(range(d * per, (d + 1) * per)), s, cp_size=mesh.cp, cp_rank=c
            )
            for d, c in mesh.shards()
        }

    plan = plan_token_exchange(
        [TeacherBatch(mesh=teacher, layouts=layouts(teacher), hidden_size=hidden, itemsize=2)],
        StudentBatch(mesh=student, layouts=layouts(student)),
    )
    w = max(teacher.rank_offset + teacher.size, student.rank_offset + student.size)
    return plan.transfer_matrix(w)


# --- the example ------------------------------------------------------------------


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
    teacher = Mesh(tp=8, pp=2, name="t")
    student = Mesh(tp=4, cp=2, dp=2, rank_offset=16, name="s")
    assert torch.equal(m, _padded_plan(teacher, student, b, s, hidden))
    # only the teacher's last stage sends, only student ranks receive, nothing stays local
    senders = torch.nonzero(m.sum(dim=1)).reshape(-1).tolist()
    receivers = torch.nonzero(m.sum(dim=0)).reshape(-1).tolist()
    assert senders == list(range(8, 16)) and receivers == list(range(16, 32))
    assert data["figures"]["bytes_local"] == 0
    # every token is sent once: B*S rows of H*2 bytes, over 8 replicas, evenly (design: within 10%)
    assert data["figures"]["send_imbalance"] <= 1.1
    assert data["figures"]["replica_imbalance"] <= 1.1
    # the all-gather inside each student TP group: (tp-1) slices per rank
    slice_rows = (b // 2) * (s // 2) // 4
    assert data["student_allgather_bytes_per_rank"][16:32] == [3 * slice_rows * hidden * 2] * 16
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 200


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
    teacher = Mesh(tp=8, pp=2, dp=4, name="t")
    student = Mesh(tp=4, cp=2, dp=8, rank_offset=64, name="s")
    assert torch.equal(m, _padded_plan(teacher, student, b, s, hidden))
    assert torch.nonzero(m.sum(dim=1)).reshape(-1).tolist() == list(teacher.last_stage_ranks())
    # big meshes print the top rows compactly, then a count of the rest
    assert "... 29 more source ranks" in out
    assert "transfer matrix" in out and "src\\dst" not in out


# --- placements and batch kinds -------------------------------------------------------------


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
    teacher = Mesh(tp=4, pp=2, name="t")
    student = Mesh(tp=2, cp=2, dp=2, name="s")
    assert torch.equal(m, _padded_plan(teacher, student, b, s, hidden))
    # student ranks 4..7 are teacher replicas (last stage 4..7): served locally, receive nothing
    diag = torch.diagonal(m)
    assert torch.nonzero(diag).reshape(-1).tolist() == [4, 5, 6, 7]
    assert data["recv_bytes"][4:8] == [0, 0, 0, 0]
    slice_bytes = (b // 2) * (s // 2) // 2 * hidden * 2
    assert diag[4:8].tolist() == [slice_bytes] * 4
    assert data["figures"]["local_copies"] == 4
    assert "colocated" in out and "local copies: ranks 4-7" in out
    assert "src\\dst" in out  # a small mesh prints the dense matrix


def test_packed_cp_sp_micro_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = [37, 5, 64, 100, 1, 23]
    hidden = 96
    out, data = _run(
        [
            "--teacher", "tp=2,cp=2,dp=2,pp=2", "--student", "tp=2,cp=3,dp=3",
            "--packed-lengths", ",".join(map(str, lengths)), "--hidden-size", str(hidden),
            "--dtype-bytes", "4", "--sequence-parallel", "both",
            "--teacher-micro-batch", "1", "--student-micro-batch", "2", "--no-png",
        ],
        tmp_path,
        capsys,
    )  # fmt: skip
    # student: dp rank d holds samples [2d, 2d+2), each padded to a multiple of 2*cp*tp = 12
    groups = {}
    for d in range(3):
        for c in range(3):
            mine = lengths[2 * d : 2 * d + 2]
            groups[f"dp{d}_cp{c}"] = sum(_zigzag_count(-(-n // 12) * 12, n, 3, c) for n in mine)
    m = _check_consistent(data, out, tokens=sum(lengths), tokens_per_group=groups)
    assert data["figures"]["student_allgather_bytes"] == 0  # the student keeps its SP slices
    assert data["figures"]["host_h2d_bytes"] == sum(lengths) * hidden * 4

    # the planner's own matrix, layouts built here the same way
    teacher = Mesh(tp=2, cp=2, dp=2, pp=2, name="t")
    student = Mesh(tp=2, cp=3, dp=3, rank_offset=16, name="s")

    def side(mesh: Mesh, mb: int, mult: int) -> dict[tuple[int, int], Any]:
        per = len(lengths) // mesh.dp
        out_l = {}
        for d, c in mesh.shards():
            parts = []
            for i in range(d * per, (d + 1) * per, mb):
                ids = list(range(i, i + mb))
                lens = [lengths[k] for k in ids]
                cu = [0]
                for n in lens:
                    cu.append(cu[-1] + -(-n // mult) * mult)
                parts.append(
                    packed_layout(ids, lens, cu_seqlens_padded=cu, cp_size=mesh.cp, cp_rank=c)
                )
            out_l[(d, c)] = concat_layouts(parts)
        return out_l

    plan = plan_token_exchange(
        [TeacherBatch(mesh=teacher, layouts=side(teacher, 1, 8), hidden_size=hidden, itemsize=4)],
        StudentBatch(mesh=student, layouts=side(student, 2, 12)),
    )
    assert torch.equal(m, plan.transfer_matrix(34))
    assert data["teacher_rows"]["dp0_cp0"] == sum(-(-n // 8) * 8 for n in lengths[:3]) // 2


def test_cli_dispatches_plan_help_and_markdown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png, md = tmp_path / "p.png", tmp_path / "p.md"
    argv = ["--teacher", "tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8"]
    assert cli.main(["plan", *argv, "--png", str(png), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "heatmap:" in out
    text = md.read_text()
    # 2 samples x 8 tokens x 4096 x 2 bytes, disjoint: all of it crosses
    assert "bytes: 128.00 KiB total = 128.00 KiB across ranks + 0 B local copies (131072 B)" in text
    assert "## Environment" in text and "![transfer matrix](p.png)" in text
    assert main(["--help"]) == 0
    assert "--packed-lengths" in capsys.readouterr().out


def test_ignored_settings_warn(tmp_path: Path) -> None:
    base = ["--teacher", "tp=2", "--batch", "2", "--seq-len", "8", "--no-png"]
    with pytest.warns(UserWarning, match="student sequence parallelism ignored: student tp=1"):
        assert main([*base, "--student", "tp=1", "--sequence-parallel", "student"]) == 0
    with pytest.warns(UserWarning, match="--nvlink-gbps 100 ignored: the student does no TP"):
        assert main([*base, "--student", "tp=1", "--nvlink-gbps", "100"]) == 0


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--teacher", "tp=8,zz=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8"],
         "unknown mesh key 'zz'"),
        (["--teacher", "tp=8,tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8"],
         "mesh key 'tp' given twice"),
        (["--teacher", "tp=0", "--student", "tp=2", "--batch", "2", "--seq-len", "8"],
         "tp must be a positive int, got 0"),
        (["--teacher", "tp=x", "--student", "tp=2", "--batch", "2", "--seq-len", "8"],
         "mesh tp='x'"),
        (["--teacher", "tp=8", "--student", "tp=2"], "one of the arguments --batch --packed-lengths"),
        (["--teacher", "tp=8", "--student", "tp=2", "--batch", "2"], "--batch needs --seq-len"),
        (["--teacher", "tp=8", "--student", "tp=2", "--packed-lengths", "3,4", "--seq-len", "8"],
         "--seq-len applies to padded batches"),
        (["--teacher", "tp=8,pp=2", "--student", "tp=4,dp=2", "--colocated", "--batch", "2",
          "--seq-len", "8"], "teacher 16 ranks and student 8"),
        (["--teacher", "tp=2", "--student", "tp=2,offset=2", "--colocated", "--batch", "2",
          "--seq-len", "8"], "drop offset= from ['student']"),
        (["--teacher", "tp=2", "--student", "tp=2,dp=3", "--batch", "4", "--seq-len", "8"],
         "batch of 4 samples does not split over the student's dp=3"),
        (["--teacher", "tp=2", "--student", "tp=2", "--batch", "4", "--seq-len", "8",
          "--student-micro-batch", "3"], "student micro-batch 3 does not divide the 4 samples"),
        (["--teacher", "tp=2", "--student", "tp=2", "--batch", "2", "--seq-len", "8",
          "--link-gbps", "0"], "0.0 must be > 0"),
        (["--teacher", "tp=2", "--student", "tp=2", "--packed-lengths", "3,0"],
         "lengths must be positive integers"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "never.png"
    assert main([*argv, "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not png.exists()


def test_parse_mesh_defaults_and_offset() -> None:
    spec = parse_mesh(" TP=4, cp=2 ,offset=16")
    assert (spec.tp, spec.cp, spec.dp, spec.pp, spec.offset, spec.size) == (4, 2, 1, 1, 16, 8)
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_mesh("tp8")
    with pytest.raises(ValueError, match="empty mesh"):
        parse_mesh(" , ")
