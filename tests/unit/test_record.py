"""What a rank contributes and reads back (``mopd.bridge.record``), without process groups.

- ``rank_roles``: the first rank of a TP group sends the runs, its replicas their digests, every
  student rank with ``keep_sp_shard``; ranks off a mesh's last stage hold nothing of it.
- The token counts in the record: ``StepView.tokens_I`` equals the count decoded from every
  student group's runs and the layouts' own count.
- Plan keys: the same inputs give the same keys; a changed layout of one DP shard changes the
  keys of exactly the ranks whose groups meet its samples, in the micro-batch it changed.
"""

from __future__ import annotations

import torch

from mopd.bridge.layout import TokenLayout, padded_layout
from mopd.bridge.mesh import Mesh
from mopd.bridge.metadata import StepMatrix, encode_step_record
from mopd.bridge.record import StepView, rank_roles, rank_sections, read_step, stack_records
from mopd.bridge.topology import Topology

TEACHER, STUDENT = Mesh(tp=2, dp=4), Mesh(tp=2, dp=4)  # colocated, every rank both
M = 3  # micro-batches


def _layouts(dp: int, i: int, short: int) -> tuple[TokenLayout, TokenLayout]:
    ids = [100 * i + 2 * dp, 100 * i + 2 * dp + 1]
    lengths = [8, 8 - short]
    return (
        padded_layout(ids, 8, lengths=lengths),
        padded_layout(ids, 8, order="bsh", lengths=lengths),
    )


def _step(changed: tuple[int, int] | None = None) -> tuple[StepView, dict[int, list]]:
    """Every rank's record, stacked and read; ``changed``: ``(dp, micro-batch)`` whose layouts
    are one token shorter."""
    topo = Topology.build([TEACHER], STUDENT)
    records, lays = [], {}
    for r in topo.members:
        c = TEACHER.coord(r)
        assert c is not None
        lays[r] = [_layouts(c.dp_rank, i, 1 if changed == (c.dp_rank, i) else 0) for i in range(M)]
        sections = rank_sections(
            rank_roles(r, [TEACHER], STUDENT),
            teacher_layouts={0: [t for t, _ in lays[r]]},
            student_layouts=[s for _, s in lays[r]],
            dtypes=[torch.float32],
            hiddens=[4],
        )
        records.append(encode_step_record(config_sig=1, n_slots=M, error="", sections=sections))
    matrix, _ = stack_records(records)
    return read_step(topo, StepMatrix(matrix), M), lays


def test_roles_follow_the_tp_leaders_and_the_last_stages() -> None:
    t, s = Mesh(tp=2, pp=2), Mesh(tp=4, rank_offset=4)
    assert rank_roles(0, [t], s) == (None, None)  # teacher's first stage, not a student
    assert rank_roles(2, [t], s) == (True, None)  # teacher's last stage, TP rank 0
    assert rank_roles(3, [t], s) == (False, None)
    assert rank_roles(4, [t], s) == (None, True)
    assert rank_roles(5, [t], s) == (None, False)
    assert rank_roles(5, [t], s, keep_sp_shard=True) == (None, True)


def test_token_counts_in_the_record_equal_the_decoded_runs() -> None:
    view, lays = _step(changed=(2, 1))
    decoded = [
        sum(int(c.dest_runs(d)[:, 4].sum()) for d in range(len(c.dests))) for c in view.catalogs
    ]
    wanted = [sum(lays[2 * dp][i][1].num_tokens for dp in range(4)) for i in range(M)]
    assert view.tokens_I().tolist() == decoded == wanted
    assert wanted[1] == wanted[0] - 1


def test_plan_keys_change_exactly_where_a_peer_changed() -> None:
    base, _ = _step()
    again, _ = _step()
    changed, _ = _step(changed=(3, 1))
    for r in range(8):
        assert base.plan_keys(r) == again.plan_keys(r)
        a, b = base.plan_keys(r), changed.plan_keys(r)
        differ = [i for i in range(M) if a[i] != b[i]]
        assert differ == ([1] if r in (6, 7) else []), (r, differ)
    # the caller's extra (row widths) is part of the key
    assert base.plan_keys(0, b"\x01") != base.plan_keys(0)
    # a rank's key covers its own groups and its peers' (rows, ranges, digests)
    # the two ranks of a TP group share their groups (one key); DP shards and micro-batches not
    assert len({k for r in range(8) for k in base.plan_keys(r)}) == 4 * M
