"""The bridge's two configs: what it must know of each teacher, and how it runs.

Why this file exists: every layer that builds a bridge (:mod:`mopd.mcore`, the tools, the tests)
states these before any group or step exists; as frozen, self-validating values they are read
by the bridge, its steps and its checks alike, and a bad value is a ``ValueError`` at
construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mopd.bridge.mesh import Mesh
from mopd.common import dist as cdist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "BridgeConfig",
    "TeacherSpec",
]

#: The bridge's default ``timeout_s`` (the library's one default, :data:`mopd.common.dist.
#: DEFAULT_TIMEOUT_S`), and the wait of a ``GroupPool``'s groups made without one (until a
#: :class:`~mopd.mcore.Distiller` on the pool bounds them by its own).
DEFAULT_TIMEOUT_S = cdist.DEFAULT_TIMEOUT_S


@dataclass(frozen=True, kw_only=True)
class TeacherSpec:
    """A teacher as the bridge sees it.

    Attributes:
        mesh: its mesh (sources are its last-stage TP groups).
        hidden_size: ``H`` of its captured hidden states.
        dtype: the captured rows' dtype (e.g. ``torch.bfloat16``); needed to plan a step
            before the teacher has run (the students allocate their buffers from it). ``None``
            is allowed with :meth:`HiddenStateBridge.exchange`, which reads it off the buffer.
        sp_shards: the teacher runs with sequence parallelism and each last-stage TP rank
            sends from its own SP shard: its layouts and buffers are that rank's
            ``[S/tp, B, H]`` slice (``micro_batch_layout(..., sp_size=tp, sp_rank=tp_rank)``,
            the capture's :meth:`~mopd.capture.OutputLayerInputCapture.get_local_hidden_states`),
            each rank is its own source and nothing is all-gathered. ``False``: the TP ranks are
            replicas of the full ``[S, B, H]`` buffer (no SP, or SP undone by the capture).
    """

    mesh: Mesh
    hidden_size: int
    dtype: torch.dtype | None = None
    sp_shards: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"TeacherSpec.mesh must be a Mesh, got {type(self.mesh).__name__}")
        if isinstance(self.hidden_size, bool) or not isinstance(self.hidden_size, int):
            raise ValueError(f"{self.mesh}: hidden_size must be an int, got {self.hidden_size!r}")
        if self.hidden_size < 1:
            raise ValueError(f"{self.mesh}: hidden_size must be >= 1, got {self.hidden_size}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"{self.mesh}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.sp_shards, bool):
            raise ValueError(f"{self.mesh}: sp_shards must be a bool, got {self.sp_shards!r}")


@dataclass(frozen=True, kw_only=True)
class BridgeConfig:
    """Settings of a :class:`HiddenStateBridge`.

    Attributes:
        timeout_s: seconds each phase may wait on other ranks (the metadata all-gather, a
            receive, the sends at :meth:`BridgeStep.finish`) before raising
            :class:`~mopd.bridge.errors.BridgeTimeoutError`. Host-side on gloo; on NCCL waits
            do not block the host (the stream waits), so hangs there are caught by the process
            groups' own timeout: create them with ``GroupPool(timeout_s=...)`` no longer than this.
        local_copy: serve a destination from a replica on the same rank by a local copy.
        keep_sp_shard: each student TP rank gets only its own sequence-parallel slice (it
            passes its own slice's layouts; no all-gather).
        max_cached_plans: schedules kept per rank (one per distinct micro-batch plan; steps with
            the same shapes reuse them).
        integrity: check every delivered row against the sender's checksum (one extra read of
            the source and of the output rows, one small message per transfer, and a verdict
            all-gather in :meth:`BridgeStep.finish`).
        duplicate_samples: allow one sample id on several student DP ranks in a micro-batch
            (refused by default: the student would train on it twice).
        check_finite: :meth:`BridgeStep.receive` checks the rows it returns for NaN / Inf and
            raises :class:`~mopd.bridge.errors.BridgeNonFiniteError` naming the teacher, the
            micro-batch and the ranks (one reduction over the rows and one host sync per
            received micro-batch).
    """

    timeout_s: float = DEFAULT_TIMEOUT_S
    local_copy: bool = True
    keep_sp_shard: bool = False
    max_cached_plans: int = 64
    integrity: bool = False
    duplicate_samples: bool = False
    check_finite: bool = True

    def __post_init__(self) -> None:
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, int | float)
            or not 0 < self.timeout_s < float("inf")
        ):
            raise ValueError(f"timeout_s must be a positive finite number, got {self.timeout_s!r}")
        if (
            isinstance(self.max_cached_plans, bool)
            or not isinstance(self.max_cached_plans, int)
            or self.max_cached_plans < 1
        ):
            raise ValueError(f"max_cached_plans must be an int >= 1, got {self.max_cached_plans!r}")
        for name in (
            "local_copy",
            "keep_sp_shard",
            "integrity",
            "duplicate_samples",
            "check_finite",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
