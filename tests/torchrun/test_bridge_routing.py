"""Tier 2 (8 ranks, gloo): on-policy steps, every one with new lengths, on the routed metadata.

Every step here is a *changed* step: new sample lengths, cut into DP shards by sample count on
the teacher's side and by tokens on the student's, so a rank's peers (the ranks whose samples
meet its own) differ from rank to rank and from step to step. What a user relies on:

- each changed step routes the records (no rank receives every record: some hold a strict
  subset, and the subsets differ between ranks), and every row arrives bit-exact, for teacher
  TP replicas and for teachers sending their own SP shards; ``global_tokens`` counts every
  wanted token once;
- a changed step with one bad rank is refused with the same ``ValueError`` on every rank,
  naming the same rank and field, word for word what a bridge that gathers every record says:
  a TP replica whose layout differs from its leader's (found by the replica in its leader's
  record), a token two DP shards hold (found by a later shard's leader in a peer's record), a
  token no teacher holds (found by the student shard's leader), and a rank that gives one
  layout too few (its own record's header: every record is gathered then);
- after a refusal the bridge plans the next changed step as before.
"""

from __future__ import annotations

import re
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mopd.bridge import api as api_mod
from mopd.bridge.api import HiddenStateBridge
from mopd.bridge.config import BridgeConfig, TeacherSpec
from mopd.bridge.groups import BridgeGroups, GroupPool, create_bridge_groups
from mopd.bridge.layout import TokenLayout, packed_layout, padded_layout
from mopd.bridge.mesh import Mesh
from mopd.profiling.synthetic import key_pattern
from tests.support.bridges import poison_outputs

TORCHRUN_NPROC = 8
TORCHRUN_TIMEOUT = 420

_TIMEOUT_S = 60.0
_H = 4
_M = 2  # micro-batches
_N = 12  # samples per micro-batch
TEACHER, STUDENT = Mesh(tp=2, dp=4), Mesh(tp=2, dp=4)  # colocated: every rank is both

POOL = GroupPool(timeout_s=_TIMEOUT_S)


def _bridge(*, sp_shards: bool = False, routed: bool = True) -> HiddenStateBridge:
    groups = create_bridge_groups(POOL, [TEACHER], STUDENT)
    if not routed:  # a bridge that gathers every record (no group for the routed rounds)
        groups = BridgeGroups(
            bridge=groups.bridge,
            student_tp=groups.student_tp,
            members=groups.members,
            meta=groups.meta,
        )
    return poison_outputs(
        HiddenStateBridge(
            teachers=[
                TeacherSpec(mesh=TEACHER, hidden_size=_H, dtype=torch.float32, sp_shards=sp_shards)
            ],
            student=STUDENT,
            groups=groups,
            config=BridgeConfig(timeout_s=_TIMEOUT_S),
        )
    )


def _samples(step: int, i: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list]:
    """Micro-batch ``i`` of step ``step``: ids, lengths (new every step), the teacher's DP
    parts (equal counts) and the student's (equal tokens)."""
    rng = np.random.default_rng(1000 * step + i)
    ids = 1000 * step + 100 * i + np.arange(_N, dtype=np.int64)
    lengths = rng.integers(1, 9, size=_N)
    teacher = np.array_split(np.arange(_N), TEACHER.dp)
    cuts = np.searchsorted(np.cumsum(lengths), np.arange(1, STUDENT.dp) * lengths.sum() / 4)
    student = np.split(np.arange(_N), cuts)
    return ids, lengths, teacher, student


def _layouts(
    step: int, rank: int, *, sp_shards: bool, bad: str = ""
) -> tuple[list[TokenLayout], list[TokenLayout]]:
    """``rank``'s teacher layouts (its TP group's ``[S, B]`` rows, or its own SP slice of a
    packed buffer) and student layouts (``[B, S]``) of every micro-batch; ``bad``: the input
    fault of that name, on its rank."""
    tc, sc = TEACHER.coord(rank), STUDENT.coord(rank)
    assert tc is not None and sc is not None
    t_out, s_out = [], []
    for i in range(_M):
        ids, lengths, teacher, student = _samples(step, i)
        t = list(teacher[tc.dp_rank])
        s = list(student[sc.dp_rank])
        if bad == "held twice" and i == 1 and tc.dp_rank == 2:
            t = [*t, int(teacher[3][0])]  # DP 3's first sample: held by two DP shards
        if bad == "held by nobody" and i == 1 and sc.dp_rank == 1:
            s = [*s, _N + 50]  # a sample id no teacher holds
        if bad == "replica differs" and i == 0 and rank == 5:
            t = t[:-1]  # rank 5 (DP 2, TP 1) drops a sample its TP leader (rank 4) holds
        lens = {j: int(lengths[j]) if j < _N else 3 for j in set(t) | set(s)}
        t_ids = [int(ids[j]) if j < _N else 1000 * step + j for j in t]
        s_ids = [int(ids[j]) if j < _N else 1000 * step + j for j in s]
        if sp_shards:
            padded = [-(-lens[j] // 2) * 2 for j in t]
            cu = np.concatenate([[0], np.cumsum(padded)]).tolist()
            t_out.append(
                packed_layout(
                    t_ids,
                    [lens[j] for j in t],
                    cu_seqlens_padded=cu,
                    sp_size=TEACHER.tp,
                    sp_rank=tc.tp_rank,
                )
            )
        else:
            t_out.append(padded_layout(t_ids, 8, lengths=[lens[j] for j in t]))
        s_out.append(padded_layout(s_ids, 8, order="bsh", lengths=[lens[j] for j in s]))
    return t_out, s_out


class _Routes:
    """Counts each rank's routed exchanges and the members whose records it received."""

    def __init__(self) -> None:
        self.held: list[list[int]] = []
        self._real = api_mod.exchange_records

    def __call__(self, *a: Any, **k: Any) -> tuple[np.ndarray, np.ndarray]:
        rows, members = self._real(*a, **k)
        self.held.append(members.tolist())
        return rows, members


def _run_step(bridge: HiddenStateBridge, step: int, *, sp_shards: bool) -> None:
    """Plan, send, receive one changed step; every row bit-exact, the tokens counted once."""
    me = dist.get_rank()
    t_lays, s_lays = _layouts(step, me, sp_shards=sp_shards)
    planned = bridge.plan_step(teacher_layouts={0: t_lays}, student_layouts=s_lays)
    with planned:
        for i, t in enumerate(t_lays):
            planned.send(i, {0: key_pattern(t, _H, torch.float32)})
        for i, s in enumerate(s_lays):
            rows = planned.receive(i)[0]
            want = key_pattern(s, _H, torch.float32)[s.sample_id_R >= 0]
            assert torch.equal(rows.view(torch.int32), want.view(torch.int32)), (step, i)
        for i in range(_M):
            assert planned.global_tokens(i) == int(_samples(step, i)[1].sum())


@pytest.mark.parametrize("sp_shards", [False, True], ids=["replicas", "sp_shards"])
def test_changed_steps_route_records_and_deliver_bit_exact_rows(sp_shards: bool) -> None:
    bridge = _bridge(sp_shards=sp_shards)
    routes = _Routes()
    with mock.patch.object(api_mod, "exchange_records", routes):
        for step in range(3):
            _run_step(bridge, step, sp_shards=sp_shards)
    assert len(routes.held) == 3  # every step changed, every step routed
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, routes.held)
    for step in range(3):
        held = [set(e[step]) for e in everyone]
        assert all(r in h for r, h in enumerate(held))  # its own record, always
        assert min(len(h) for h in held) < dist.get_world_size(), held  # not every record
        assert len({frozenset(h) for h in held}) > 1, held  # peers differ between ranks
    bridge.close()


_FAULTS = {
    "replica differs": r"bridge input rejected \(found by global rank 5\): teacher 0 TP replicas "
    r"\[4, 5\] \(teacher 0 \(dp=2, cp=0\)\) hold different token layouts in micro-batch 0",
    "held twice": r"bridge input rejected \(found by global rank 6\): micro-batch 1: token "
    r"\(sample_id=1109, position=0\) is held twice",
    "held by nobody": r"bridge input rejected \(found by global rank 2\): micro-batch 1: token "
    r"\(sample_id=1062, position=0\) is needed by student \(dp=1, cp=0\)",
    "one layout too few": r"bridge input rejected on global rank\(s\) \[3\]: global rank 3: "
    r"this rank gives different micro-batch counts",
}


def _refusal(bridge: HiddenStateBridge, fault: str) -> str:
    """The ValueError ``bridge`` raises on step 1 with ``fault``, the same on every rank."""
    me = dist.get_rank()
    t_lays, s_lays = _layouts(1, me, sp_shards=False, bad=fault)
    if fault == "one layout too few" and me == 3:
        s_lays = s_lays[:1]
    with pytest.raises(ValueError) as err:
        bridge.plan_step(teacher_layouts={0: t_lays}, student_layouts=s_lays)
    texts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(texts, str(err.value))
    assert len(set(texts)) == 1, texts  # refused alike everywhere
    return texts[0]


@pytest.mark.parametrize("fault", list(_FAULTS))
def test_a_changed_step_with_one_bad_rank_is_refused_alike_everywhere(fault: str) -> None:
    routed, gathered = _bridge(), _bridge(routed=False)
    routes = _Routes()
    with mock.patch.object(api_mod, "exchange_records", routes):
        _run_step(routed, 0, sp_shards=False)
        text = _refusal(routed, fault)
        assert len(routes.held) == (2 if fault != "one layout too few" else 1)
        _run_step(routed, 2, sp_shards=False)  # the agreed refusal left the bridge usable
    assert text == _refusal(gathered, fault)  # what every record says, word for word
    assert re.search(_FAULTS[fault], text), text
    routed.close()
    gathered.close()
