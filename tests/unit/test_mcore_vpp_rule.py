"""Tier 1: the virtual-pipeline micro-batch rule, checked before a step starts.

megatron's interleaved schedule refuses a micro-batch count only once the step is running ("The
remainder of M ... should be 0, or larger than or equal to the pipeline-parallel size"): a
pipelined student on virtual stages with 3 micro-batches at PP=2 then fails after the teachers
ran. ``check_interleaved_micro_batches`` (called by ``Distiller.step`` inside the bridge's agreed
verdict, so every rank gets the same ``ValueError`` before anything moves) applies the same rule
up front; here every case of a grid is compared with the rule as megatron's schedule states it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mopd.mcore.teacher import check_interleaved_micro_batches


class _Chunk(torch.nn.Module):
    def __init__(self, group: int | None) -> None:
        super().__init__()
        self.config = SimpleNamespace(microbatch_group_size_per_vp_stage=group)


def _megatron_refuses(m: int, pp: int, n: int) -> bool:
    """megatron-core's two checks in ``forward_backward_pipelining_with_interleaving``."""
    return n > m or n < pp or 0 < m % n < pp


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("group", [None, 3, 5])
def test_refuses_exactly_what_the_interleaved_schedule_refuses(pp: int, group: int | None) -> None:
    chunks = [_Chunk(group), _Chunk(group)]
    n = group or pp  # megatron's default group size is the pipeline size
    for m in range(1, 13):
        if _megatron_refuses(m, pp, n):
            with pytest.raises(ValueError) as exc:
                check_interleaved_micro_batches(m, model=chunks, pp=pp, what="student")
            text = str(exc.value)
            assert text.startswith(f"student: {m} micro-batches for 2 virtual-pipeline chunks")
            assert f"microbatch_group_size_per_vp_stage = {n}" in text
            assert f"M % N = {m % n}" in text
            if n < pp:  # no micro-batch count helps: the group size is named
                assert f"set microbatch_group_size_per_vp_stage to at least {pp}" in text
                continue
            assert f"use a multiple of {n}" in text
            for ok in map(int, text.rsplit("(e.g. ", 1)[1].rstrip(")").split(", ")):
                assert not _megatron_refuses(ok, pp, n), (ok, text)  # the advice is right
        else:
            check_interleaved_micro_batches(m, model=chunks, pp=pp, what="student")


def test_no_interleaving_no_rule() -> None:
    one = _Chunk(None)
    for m in range(1, 6):
        check_interleaved_micro_batches(m, model=one, pp=2, what="student")  # one chunk
        check_interleaved_micro_batches(m, model=[one], pp=2, what="student")
        check_interleaved_micro_batches(m, model=[one, one], pp=1, what="student")  # no pipeline
