"""Tier 1: the vocabulary rule (:mod:`mopd.mcore.megatron_lm_head`): the real vocabulary is said once,
models may each be padded to their own size, and a size read off the models must agree."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mopd.mcore.megatron_lm_head import MEGATRON_VOCAB_MULTIPLE, looks_padded, resolve_vocab_size


def test_a_given_vocabulary_wins_over_every_padded_size() -> None:
    sizes = [("teacher 0", 1024), ("teacher 1", 1008), ("the student", 1008)]
    assert resolve_vocab_size(1000, sizes) == (1000, True)
    assert resolve_vocab_size(1008, sizes) == (1008, True)


def test_a_given_vocabulary_larger_than_a_model_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        resolve_vocab_size(1010, [("teacher 0", 1024), ("the student", 1008)])
    assert str(info.value) == (
        "vocab_size=1010 is larger than the vocabulary of the student (1008): every model must "
        "be built with at least the real vocabulary (teacher 0 1024, the student 1008)"
    )


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "1000"])
def test_a_given_vocabulary_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="vocab_size must be a positive int"):
        resolve_vocab_size(bad, [])  # type: ignore[arg-type]


def test_without_one_the_models_must_agree() -> None:
    assert resolve_vocab_size(None, [("teacher 0", 64), ("the student", 64)]) == (64, False)
    with pytest.raises(ValueError) as info:
        resolve_vocab_size(None, [("teacher 0", 1024), ("the student", 1008)])
    msg = str(info.value)
    assert msg.startswith(
        "the models' vocab_size attributes differ (teacher 0 1024, the student 1008)"
    )
    assert msg.endswith("pass vocab_size=<the tokenizer's vocabulary, at most 1008>")


def test_looks_padded_is_megatrons_multiple_above_every_token_seen() -> None:
    assert MEGATRON_VOCAB_MULTIPLE == 128
    assert looks_padded(1024, 999)
    assert not looks_padded(1024, 1023)  # the last id is used: not padding
    assert not looks_padded(1008, 999)  # not a multiple of 128
    assert not looks_padded(64, 10)


# --- an LM head sharded below its TP shard (megatron-core's GTP) is refused by name ------------


class _GTPShardedParam(torch.nn.Parameter):
    """A stand-in for megatron-core 0.19's GTP weight class (its name is what is checked)."""


_GTPShardedParam.__name__ = "GTPShardedParam"


class _Head(torch.nn.Module):
    """An output layer holding ``rows`` rows of ``H`` (a ``gtp_remat_size`` if given)."""

    def __init__(self, rows: int, *, remat: int | None = None, cls: type = torch.nn.Parameter):
        super().__init__()
        self.weight = cls(torch.randn(rows, H))
        if remat is not None:
            self.gtp_remat_size = remat


class _Model(torch.nn.Module):
    def __init__(self, head: torch.nn.Module, vocab: int) -> None:
        super().__init__()
        self.output_layer = head
        self.vocab_size = vocab


H, V_PAD, TP = 16, 256, 2


@pytest.mark.parametrize(
    ("head", "says"),
    [
        (_Head(V_PAD // TP // 2, remat=2), "(gtp_remat_size=2)"),
        (_Head(V_PAD // TP // 2 + 8, remat=2), "holds 72 rows"),  # the GTP slice, padded
        (_Head(V_PAD // TP, cls=_GTPShardedParam), "a GTPShardedParam"),
        (_Head(V_PAD // TP // 4), "holds 32 rows"),  # no marker: the shape alone
    ],
    ids=["gtp2", "gtp2-padded", "gtp-param", "short"],
)
def test_a_head_sharded_below_its_tp_shard_is_refused_by_name(head: Any, says: str) -> None:
    from mopd.mcore.megatron_lm_head import head_shard_problem

    msg = head_shard_problem(head, head.weight, vocab=V_PAD, tp=TP, what="teacher 0")
    assert msg is not None and msg.startswith("teacher 0: its output_layer.weight holds "), msg
    assert says in msg and "where its TP shard has 128 (vocab_size 256 / tp 2)" in msg, msg
    assert "partial head" in msg and "tensor_parallel_num_weight_shards" in msg, msg
    whole = _Head(V_PAD // TP, remat=1)
    assert head_shard_problem(whole, whole.weight, vocab=V_PAD, tp=TP, what="teacher 0") is None


def test_lm_head_from_models_refuses_a_gtp_sharded_teacher_head_before_any_row_moves() -> None:
    """One rank (teacher and student colocated, ``tp=1``): the teacher's head holds half its
    rows under ``gtp_remat_size=2`` -> the same ``ValueError`` every rank would raise, from the
    verdict before the sizes are agreed; a whole head passes."""
    import datetime

    import torch.distributed as dist

    from mopd.bridge import GroupPool, Mesh, create_bridge_groups
    from mopd.mcore import lm_head_from_models

    fresh = not dist.is_initialized()
    if fresh:
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=30),
        )
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already initialized")
    try:
        with GroupPool(timeout_s=30) as pool:
            mesh = Mesh()
            groups = create_bridge_groups(pool, [mesh], mesh)
            student = _Model(_Head(V_PAD), V_PAD)
            split = _Model(_Head(V_PAD // 2, remat=2), V_PAD)
            with pytest.raises(ValueError) as info:
                lm_head_from_models(split, student, teacher=mesh, student=mesh, groups=groups)
            assert str(info.value).startswith(
                "the LM head rejected: global rank 0: the teacher: its output_layer.weight holds "
                "128 rows ((128, 16), a Parameter) where its TP shard has 256"
            ), info.value
            whole = _Model(_Head(V_PAD), V_PAD)
            shard = lm_head_from_models(whole, student, teacher=mesh, student=mesh, groups=groups)
            assert shard is not None
    finally:
        if fresh:
            dist.destroy_process_group()
