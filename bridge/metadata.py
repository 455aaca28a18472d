"""Layout metadata: what each rank holds and wants, encoded as small int64 vectors and all-gathered.

Why this file exists: the plan must be identical on every rank and bad input must fail on every
rank the same way. Each rank therefore encodes its own view (the layouts of its buffers as runs,
their shapes, dtypes, devices, and any local error it hit while building them) into one int64
vector; :func:`gather_records` all-gathers those vectors over the bridge group (two collectives,
sizes then padded payloads, both with timeouts) and every rank decodes the same list.

Record layout (one int64 vector)::

    [config_sig, n_owners,
     err_len, err_chars...,
     per owner:  present, hidden, dtype_code, device_code, n_rows, n_runs, runs (5 * n_runs)...,
     student:    present, n_rows, n_runs, runs...,
     per owner:  out_present, out_rows, out_hidden, out_dtype_code, out_device_code]
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mopd.bridge.groups import all_gather_flat
from mopd.bridge.layout import TokenLayout, layout_from_runs, layout_to_runs

__all__ = [
    "DTYPES",
    "BufferRecord",
    "RankRecord",
    "code_device",
    "code_dtype",
    "decode_record",
    "decode_records",
    "device_code",
    "dtype_code",
    "encode_record",
    "gather_record_matrix",
    "gather_records",
]

_I64 = torch.int64

#: dtype <-> code table (index = code).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
)
_DEVICES = ("cpu", "cuda")


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def device_code(device: torch.device) -> int:
    return _DEVICES.index(device.type) if device.type in _DEVICES else len(_DEVICES)


def code_dtype(code: int) -> torch.dtype | None:
    return DTYPES[code] if 0 <= code < len(DTYPES) else None


def code_device(code: int) -> str:
    return _DEVICES[code] if 0 <= code < len(_DEVICES) else "other"


@dataclass(frozen=True, kw_only=True, eq=False)
class BufferRecord:
    """One buffer a rank holds or wants: its rows, hidden size, dtype and device type."""

    rows: int
    hidden: int
    dtype: torch.dtype | None
    device: str
    layout: TokenLayout | None = None


@dataclass(frozen=True, kw_only=True, eq=False)
class RankRecord:
    """A rank's decoded metadata.

    Attributes:
        rank: global rank.
        config_sig: hash of the meshes and settings the rank was built with.
        error: the local error message, or ``""``.
        sources: per owner, the captured buffer this rank holds (``None`` if none).
        student: the student layout this rank wants (``None`` if none).
        outputs: per owner, the output buffer this rank passed (``None`` if none).
    """

    rank: int
    config_sig: int
    error: str
    sources: tuple[BufferRecord | None, ...]
    student: TokenLayout | None
    outputs: tuple[BufferRecord | None, ...]


def encode_record(
    *,
    config_sig: int,
    error: str,
    sources: Sequence[tuple[TokenLayout, int, torch.dtype, torch.device] | None],
    student: TokenLayout | None,
    outputs: Sequence[tuple[int, int, torch.dtype, torch.device] | None],
) -> torch.Tensor:
    """Encode one rank's view (see the module doc). ``outputs`` entries are ``(rows, hidden, dtype, device)``."""
    out: list[torch.Tensor] = [torch.tensor([config_sig, len(sources)], dtype=_I64)]
    err = error.encode()[:4000]
    out.append(torch.tensor([len(err), *err], dtype=_I64))
    for s in sources:
        if s is None:
            out.append(torch.zeros(6, dtype=_I64))
            continue
        layout, hidden, dtype, device = s
        runs = layout_to_runs(layout)
        out.append(
            torch.tensor(
                [1, hidden, dtype_code(dtype), device_code(device), layout.num_rows, runs.shape[0]],
                dtype=_I64,
            )
        )
        out.append(runs.reshape(-1))
    if student is None:
        out.append(torch.zeros(3, dtype=_I64))
    else:
        runs = layout_to_runs(student)
        out.append(torch.tensor([1, student.num_rows, runs.shape[0]], dtype=_I64))
        out.append(runs.reshape(-1))
    for o in outputs:
        if o is None:
            out.append(torch.zeros(5, dtype=_I64))
        else:
            rows, hidden, dtype, device = o
            out.append(
                torch.tensor([1, rows, hidden, dtype_code(dtype), device_code(device)], dtype=_I64)
            )
    return torch.cat(out)


def decode_record(rank: int, vec: torch.Tensor) -> RankRecord:
    """Invert :func:`encode_record`."""
    v = vec.tolist()
    i = 0

    def take(n: int) -> list[int]:
        nonlocal i
        got = v[i : i + n]
        i += n
        return got

    sig, n_owners = take(2)
    (n_err,) = take(1)
    error = bytes(take(n_err)).decode(errors="replace")
    sources: list[BufferRecord | None] = []
    for _ in range(n_owners):
        present, hidden, dt, dv, rows, n_runs = take(6)
        if not present:
            sources.append(None)
            continue
        runs = vec[i : i + 5 * n_runs].reshape(-1, 5)
        i += 5 * n_runs
        sources.append(
            BufferRecord(
                rows=rows,
                hidden=hidden,
                dtype=code_dtype(dt),
                device=code_device(dv),
                layout=layout_from_runs(runs, rows),
            )
        )
    present, rows, n_runs = take(3)
    student = None
    if present:
        runs = vec[i : i + 5 * n_runs].reshape(-1, 5)
        i += 5 * n_runs
        student = layout_from_runs(runs, rows)
    outputs: list[BufferRecord | None] = []
    for _ in range(n_owners):
        present, rows, hidden, dt, dv = take(5)
        outputs.append(
            BufferRecord(rows=rows, hidden=hidden, dtype=code_dtype(dt), device=code_device(dv))
            if present
            else None
        )
    return RankRecord(
        rank=rank,
        config_sig=sig,
        error=error,
        sources=tuple(sources),
        student=student,
        outputs=tuple(outputs),
    )


def gather_record_matrix(
    record: torch.Tensor,
    *,
    group: Any,
    members: Sequence[int],
    device: torch.device,
    timeout: datetime.timedelta,
) -> tuple[torch.Tensor, list[int]]:
    """All-gather every member's encoded record over ``group``: ``([n, width] int64 CPU, sizes)``.

    Row ``j`` holds member ``j``'s record in its first ``sizes[j]`` entries (zero-padded after);
    the result is identical on every rank. ``members`` are the group's global ranks in group-rank
    order (sorted). Tensors travel on ``device`` (CUDA for NCCL groups, CPU for gloo).
    """
    n = len(members)
    size = torch.tensor([record.numel()], dtype=_I64, device=device)
    sizes = torch.empty(n, dtype=_I64, device=device)
    all_gather_flat(sizes, size, group=group, timeout=timeout)
    sizes_l = sizes.cpu().tolist()
    width = max(sizes_l)
    padded = torch.zeros(width, dtype=_I64, device=device)
    padded[: record.numel()] = record.to(device)
    everything = torch.empty(n * width, dtype=_I64, device=device)
    all_gather_flat(everything, padded, group=group, timeout=timeout)
    return everything.cpu().view(n, width), sizes_l


def decode_records(
    matrix: torch.Tensor, sizes: Sequence[int], members: Sequence[int]
) -> list[RankRecord]:
    """Decode :func:`gather_record_matrix`'s output into one :class:`RankRecord` per member."""
    return [decode_record(members[j], matrix[j, : sizes[j]]) for j in range(len(members))]


def gather_records(
    record: torch.Tensor,
    *,
    group: Any,
    members: Sequence[int],
    device: torch.device,
    timeout: datetime.timedelta,
) -> list[RankRecord]:
    """All-gather every member's encoded record over ``group`` and decode them (same list everywhere)."""
    matrix, sizes = gather_record_matrix(
        record, group=group, members=members, device=device, timeout=timeout
    )
    return decode_records(matrix, sizes, members)
