"""``mopd plan``'s text and JSON: a :class:`~mopd.profiling.plan.figures.PlanReport` in words.

Why this file exists: the report a person reads (:func:`format_report`) and the one a script
reads (:func:`report_to_dict`) say the same figures; the byte and time formats live here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mopd.bridge.mesh import Mesh

from mopd.common.units import human_bytes, human_seconds, rank_list
from mopd.profiling.plan.figures import DENSE_MAX_WORLD, LINK_CLASSES, PlanReport
from mopd.profiling.plan.request import pad_rule

__all__ = [
    "format_report",
    "report_to_dict",
]


def _row_entries(dst: Sequence[int], nbytes: Sequence[int]) -> str:
    """One matrix row's entries (ascending destinations), consecutive equal ones merged."""
    parts: list[str] = []
    i = 0
    while i < len(dst):
        j = i
        while j + 1 < len(dst) and dst[j + 1] == dst[j] + 1 and nbytes[j + 1] == nbytes[i]:
            j += 1
        who = str(dst[i]) if i == j else f"{dst[i]}-{dst[j]}"
        each = " each" if j > i else ""
        parts.append(f"{who}: {human_bytes(nbytes[i])}{each}")
        i = j + 1
    return "; ".join(parts)


def _mesh_line(mesh: Mesh, sp: bool) -> str:
    return (
        f"TP{mesh.tp} CP{mesh.cp} DP{mesh.dp} PP{mesh.pp}{' SP' if sp and mesh.tp > 1 else ''}, "
        f"global ranks {mesh.rank_offset}..{mesh.rank_offset + mesh.size - 1}, "
        f"last stage {rank_list(mesh.last_stage_ranks(), sep=',')}"
    )


def _rows_text(rows: Mapping[Any, tuple[int, ...]]) -> str:
    return str(sorted({n for v in rows.values() for n in v}))


def format_report(report: PlanReport, *, top: int = 8) -> str:
    """The printed summary: setup, matrix, per-rank volumes, comparisons, times."""
    from mopd.bridge.layout import megatron_padded_length
    from mopd.bridge.mesh import meshes_overlap

    req, f = report.request, report.figures
    t, s = req.teacher, req.student
    w = report.world_size
    lines: list[str] = []
    add = lines.append
    placement = "colocated (shared ranks)" if meshes_overlap([t, s]) else "disjoint"
    add(f"teacher: {_mesh_line(t, req.teacher_sp)}")
    add(f"student: {_mesh_line(s, req.student_sp)}")
    add(f"placement: {placement}; world size {w}")
    b = len(req.lengths)
    if req.padded_seq_len is not None:
        batch = f"padded, B={b} x S={req.padded_seq_len}"
    else:
        shown = ",".join(map(str, req.lengths[:8])) + (",..." if b > 8 else "")
        batch = f"packed (THD), {b} samples, lengths {shown}"
    m = req.micro_batches
    add(f"batch: {batch}; {f['tokens']} tokens; {m} micro-batch{'es' if m > 1 else ''}")
    per_mb = b // m
    sp_note = ", each rank its own SP slice" if req.keeps_sp_slice else ""
    add(
        f"buffers per micro-batch: teacher {_rows_text(report.teacher_rows)} rows per "
        f"{'TP rank (its SP shard) of a ' if req.sources_from_shards else ''}(dp, cp) "
        f"shard ({per_mb // t.dp} samples), student {_rows_text(report.student_rows)} rows "
        f"({per_mb // s.dp} samples{sp_note}); padding rows never move"
    )
    add(
        f"row: hidden {req.hidden_size} x {req.dtype_bytes} B = {human_bytes(req.row_bytes)}; "
        f"vocab {req.vocab_size}"
    )
    if req.padded_seq_len is not None:
        for side, mesh, sp in (("teacher", t, req.teacher_sp), ("student", s, req.student_sp)):
            pad = pad_rule(mesh, sp=sp)
            padded = megatron_padded_length(req.padded_seq_len, **pad)
            mult = megatron_padded_length(1, **pad)
            if padded != req.padded_seq_len:
                add(
                    f"note: {side} sequences padded to {padded} (a multiple of {mult}); "
                    f"positions {req.padded_seq_len}.. are padding"
                )
    if req.teacher_sp and t.tp > 1:
        add(
            "note: teacher SP: each teacher TP rank sends from its own SP shard (its own source, "
            "no all-gather on the teacher's TP links)"
            if req.sources_from_shards
            else "note: teacher SP with replica sources: the capture all-gathers the sequence "
            "over the teacher's TP group before the bridge (--teacher-sp-replicas)"
        )
    add("")
    add("== plan (mopd.bridge.plan.plan_rank on every rank, every micro-batch) ==")
    add(
        f"{f['transfers']} transfers: {f['messages']} messages between ranks "
        f"({f['rank_pairs']} rank pairs), {f['local_copies']} local copies; "
        f"{f['tokens_needed']} token rows delivered, each once per student "
        f"{'rank (SP slice)' if req.keeps_sp_slice else '(dp, cp) group'}"
    )
    minimum = (
        "= the minimum"
        if f["bytes_total"] == f["bytes_minimum"]
        else (f"!= the minimum {f['bytes_minimum']} B")
    )
    add(
        f"bytes: {human_bytes(f['bytes_total'])} total = {human_bytes(f['bytes_cross'])} across ranks "
        f"+ {human_bytes(f['bytes_local'])} local copies ({f['bytes_total']} B, {minimum}: "
        "tokens x row)"
    )
    add("")
    add("== bytes per link class, per step (beside the minimum) ==")
    links, floor = f["link_bytes"], f["link_bytes_minimum"]
    add(f"{'link class':<52}{'bytes':>14}{'minimum':>14}")
    for key, what in LINK_CLASSES:
        low = "" if key in ("cross", "local") else human_bytes(floor[key])
        add(f"{what:<52}{human_bytes(links[key]):>14}{low:>14}")
    add(
        f"{'  crossing + local copies (each needed row once)':<52}"
        f"{human_bytes(links['cross'] + links['local']):>14}"
        f"{human_bytes(floor['cross_plus_local']):>14}"
    )
    add(
        f"{'total':<52}{human_bytes(f['link_bytes_total']):>14}"
        f"{human_bytes(f['link_bytes_total_minimum']):>14}"
    )
    add(
        "at the minimum"
        if f["links_at_minimum"]
        else f"above the minimum by {human_bytes(f['link_bytes_total'] - f['link_bytes_total_minimum'])}"
        + (
            " (the teacher's SP all-gather: send from the shards, the default)"
            if links["teacher_tp"]
            else ""
        )
    )
    add("")
    add("== transfer matrix: bytes, source global rank (row) -> destination (column) ==")
    e = report.entries_E3
    if w <= DENSE_MAX_WORLD:
        dense = report.dense()
        unit, scale = ("MiB", 2**20) if int(dense.max(initial=0)) >= 2**20 else ("KiB", 2**10)
        add(f"(in {unit}; '.' = nothing; the diagonal is local copies)")
        add("src\\dst " + "".join(f"{j:>8}" for j in range(w)))
        for i in range(w):
            cells = "".join(
                f"{int(x) / scale:>8.1f}" if int(x) else f"{'.':>8}" for x in dense[i].tolist()
            )
            add(f"{i:>7} {cells}")
    by_src: dict[int, tuple[list[int], list[int]]] = {}
    for a, b_, n in e.tolist():
        dst, nb = by_src.setdefault(a, ([], []))
        dst.append(b_)
        nb.append(n)
    order = sorted(by_src, key=lambda r: (-sum(by_src[r][1]), r))
    shown_rows = order[:top]
    add(f"{len(by_src)} source ranks, {e.shape[0]} nonzero entries; top {len(shown_rows)} rows:")
    for r in shown_rows:
        dst, nb = by_src[r]
        add(f"  {r:>5} ({human_bytes(sum(nb))}) -> {_row_entries(dst, nb)}")
    if len(order) > len(shown_rows):
        rest = sum(sum(by_src[r][1]) for r in order[len(shown_rows) :])
        add(f"  ... {len(order) - len(shown_rows)} more source ranks, {human_bytes(rest)}")
    add(f"  total {human_bytes(int(e[:, 2].sum()))}")
    add("")
    add("== per-rank volume across ranks (local copies apart) ==")
    for what, v in (("send", report.send_W), ("recv", report.recv_W)):
        nz = np.flatnonzero(v).tolist()
        if not nz:
            add(f"{what}: nobody")
            continue
        vals = v[nz]
        groups: dict[int, list[int]] = {}
        for r in nz:
            groups.setdefault(int(v[r]), []).append(r)
        add(
            f"{what}: {len(nz)} ranks, max {human_bytes(int(vals.max()))}, "
            f"mean {human_bytes(float(vals.mean()))}, min {human_bytes(int(vals.min()))}, "
            f"imbalance max/mean {f[what + '_imbalance']:.4f}"
        )
        for val, ranks in sorted(groups.items(), key=lambda kv: -kv[0])[:top]:
            add(f"  {human_bytes(val)}: ranks {rank_list(ranks, sep=',')}")
        if len(groups) > top:
            add(f"  ... {len(groups) - top} more distinct volumes")
    if f["bytes_local"]:
        nz = np.flatnonzero(report.local_W).tolist()
        add(f"local copies: ranks {rank_list(nz, sep=',')}, {human_bytes(f['bytes_local'])} in all")
    if not req.sources_from_shards:  # a source is one rank: nothing to balance within it
        add(f"teacher TP replica balance: max/mean {f['replica_imbalance']:.4f}")
    add("")
    add("== bytes compared (ratio = bytes / this plan's total) ==")
    tot = f["bytes_total"]
    add(f"{'path':<58}{'bytes':>14}{'ratio':>10}")
    table = [
        ("bridge: hidden states GPU->GPU (this plan)", tot),
        (f"logits: full vocab to each of the student's tp={s.tp} ranks", f["logits_full_bytes"]),
        ("logits: vocab slice to each student TP rank (best case)", f["logits_sharded_bytes"]),
        ("host path: PCIe bytes (D2H + H2D)", f["host_pcie_bytes"]),
        ("host path: PCIe + host-to-host network bytes", f["host_pcie_bytes"] + f["bytes_cross"]),
    ]
    for name, nbytes in table:
        ratio = nbytes / tot if tot else 0.0
        add(f"{name:<58}{human_bytes(nbytes):>14}{ratio:>9.2f}x")
    add(
        f"host path: D2H {human_bytes(f['host_d2h_bytes'])} on teacher ranks, "
        f"H2D {human_bytes(f['host_h2d_bytes'])} on student ranks "
        f"({'SP slices' if req.keeps_sp_slice else 'every TP rank loads its whole shard'}); "
        f"{f['host_hops_per_token']} hops per token (D2H, network, H2D) vs "
        f"{f['bridge_hops_per_token']} (GPU->GPU)"
    )
    add(
        f"student TP all-gather after the crossing: {human_bytes(f['student_allgather_bytes'])} "
        + (
            "(none: the student keeps SP slices)"
            if req.keeps_sp_slice or s.tp == 1
            else "(ring, inside each TP group)"
        )
    )
    add("")
    per = "per micro-batch the slowest rank's max(send, recv) / link, added over micro-batches"
    add(
        f"== time (model: {per if m > 1 else 'the slowest rank max(send, recv) / link'}; "
        f"link {req.link_gbps:g} Gb/s per rank, NVLink {req.nvlink_gbps:g} Gb/s, "
        f"PCIe {req.pcie_gbps:g} Gb/s) =="
    )
    slow = f["slowest_rank"]
    add(
        f"bridge crossing: {human_seconds(f['time_cross_s'])} (slowest rank {slow}: send "
        f"{human_bytes(int(report.send_W[slow]))}, recv {human_bytes(int(report.recv_W[slow]))})"
    )
    add(f"student TP all-gather (NVLink): {human_seconds(f['time_student_allgather_s'])}")
    if f["teacher_tp_gather_bytes"]:
        add(
            "teacher SP all-gather before the bridge (NVLink): "
            f"{human_seconds(f['time_teacher_tp_gather_s'])}"
        )
    add(f"bridge total: {human_seconds(f['time_bridge_s'])}")
    add(
        f"logits, same routing: full {human_seconds(f['time_logits_full_s'])}, "
        f"vocab slice {human_seconds(f['time_logits_sharded_s'])}"
    )
    add(
        f"host path (stages in sequence): D2H {human_seconds(f['time_host_d2h_s'])} + network "
        f"{human_seconds(f['time_cross_s'])} + H2D {human_seconds(f['time_host_h2d_s'])} = "
        f"{human_seconds(f['time_host_s'])} ({f['host_time_ratio']:.2f}x the bridge)"
    )
    return "\n".join(lines) + "\n"


def _shard_key(k: Any) -> str:
    return f"dp{k[0]}_cp{k[1]}" if isinstance(k, tuple) else f"rank{k}"


def report_to_dict(report: PlanReport) -> dict[str, Any]:
    """Every number of ``report`` as JSON-ready data (the matrix as its nonzero entries)."""
    req = report.request

    def mesh(x: Mesh, sp: bool, **more: Any) -> dict[str, Any]:
        return {
            "tp": x.tp,
            "pp": x.pp,
            "cp": x.cp,
            "dp": x.dp,
            "rank_offset": x.rank_offset,
            "sp": sp,
            **more,
        }

    return {
        "teacher": mesh(req.teacher, req.teacher_sp, sp_shards=req.sources_from_shards),
        "sources_from_shards": req.sources_from_shards,
        "student": mesh(req.student, req.student_sp),
        "batch": {
            "kind": "padded" if req.padded_seq_len is not None else "packed",
            "lengths": list(req.lengths),
            "seq_len": req.padded_seq_len,
            "micro_batches": req.micro_batches,
        },
        "hidden_size": req.hidden_size,
        "vocab_size": req.vocab_size,
        "dtype_bytes": req.dtype_bytes,
        "world_size": report.world_size,
        "matrix": report.entries_E3.tolist(),
        "send_bytes": report.send_W.tolist(),
        "recv_bytes": report.recv_W.tolist(),
        "local_bytes": report.local_W.tolist(),
        "send_bytes_per_micro_batch": report.send_MW.tolist(),
        "recv_bytes_per_micro_batch": report.recv_MW.tolist(),
        "student_allgather_bytes_per_rank": report.allgather_MW.sum(0).tolist(),
        "teacher_tp_gather_bytes_per_rank": report.teacher_gather_MW.sum(0).tolist(),
        "host_d2h_bytes_per_rank": report.d2h_MW.sum(0).tolist(),
        "host_h2d_bytes_per_rank": report.h2d_MW.sum(0).tolist(),
        "teacher_rows": {_shard_key(k): list(v) for k, v in sorted(report.teacher_rows.items())},
        "student_rows": {
            _shard_key(k): list(v)
            for k, v in sorted(report.student_rows.items(), key=lambda kv: str(kv[0]))
        },
        "tokens_per_student_group": {
            _shard_key(k): n
            for k, n in zip(req.student.shards(), report.tokens_per_group, strict=True)
        },
        "figures": dict(report.figures),
    }
