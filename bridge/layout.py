"""Token layouts: which global token ``(sample_id, position)`` each row of a local buffer holds.

Why this file exists: teacher and student batch, pack, shard and order tokens differently. The
bridge never reasons about those schemes; it joins the *keys* of source rows and destination rows.
This module turns every supported scheme into one explicit form, :class:`TokenLayout`.

Conventions (all tensors int64, on the CPU, describing a buffer seen as its flat row view
``buffer.view(-1, H)``; the buffer must be contiguous):

- ``[S, B, H]`` padded batch (Megatron's default, ``order="sbh"``): row ``s * B + b``.
- ``[B, S, H]`` padded batch (``order="bsh"``): row ``b * S + s``.
- ``[T, 1, H]`` packed sequences (THD, Megatron's packed layout): row ``t``; sequence ``i``
  occupies ``cu_seqlens_padded[i] : cu_seqlens_padded[i + 1]`` (each padded to a multiple of
  ``2 * cp``, times ``tp`` under SP), its tail past the real length is padding.
- Context parallelism (Megatron's load balancing): a sequence of (padded) length ``P`` is cut
  into ``2 * cp`` chunks of ``P / (2 * cp)``; CP rank ``r`` holds chunk ``r`` then chunk
  ``2 * cp - 1 - r``, concatenated. Padded batches cut the whole ``S`` this way; THD cuts each
  sequence separately and concatenates the rank's pieces in sequence order.
- Sequence parallelism: after CP, the sequence dimension (``S``, or ``T`` for THD) is split into
  ``sp`` equal contiguous slices; SP rank ``k`` holds slice ``k``.
- Data parallelism and micro-batches: each rank is given its own global ``sample_ids``; a buffer
  holding several micro-batches one after another is :func:`concat_layouts` of theirs.
- Padding rows have ``sample_id == position == -1``. Sample ids are global and link teacher and
  student, so both sides may batch, pack and order samples differently.
- The LM head reshard reuses the same form with ``sample_id = 0`` and ``position = vocab row``
  (:mod:`mopd.bridge.lm_head`).

A layout travels between ranks as runs (:func:`layout_to_runs`): rows of one sample with
consecutive positions and a constant row step, so a ``[S, B, H]`` batch is ``B`` runs per CP chunk.
:func:`padded_layout` and :func:`packed_layout` derive those runs from their few pieces (a CP
chunk of a column or of a sequence) when they build the layout, so turning a layout into runs
each step costs no per-row sort; the runs are exactly those the per-row path gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from mopd.common.digest import Digest

__all__ = [
    "TokenLayout",
    "concat_layouts",
    "cp_positions",
    "encode_keys",
    "layout_from_runs",
    "layout_to_runs",
    "megatron_padded_length",
    "packed_layout",
    "packed_layouts",
    "padded_layout",
    "token_keys",
]

_I64 = torch.int64


@dataclass(frozen=True, kw_only=True, eq=False)
class TokenLayout:
    """The global key of every row of one local buffer.

    Attributes:
        sample_id_R: ``[R]`` int64, the global sample id of row ``r`` or ``-1`` for padding.
        position_R: ``[R]`` int64, the token position inside its sample, or ``-1`` for padding.

    A layout from :func:`packed_layouts` is built from its runs and makes these two tensors on
    first read (the bridge reads runs; a step need not pay for rows nobody reads).
    """

    sample_id_R: torch.Tensor
    position_R: torch.Tensor

    def __post_init__(self) -> None:
        s, p = self.sample_id_R, self.position_R
        if s.dim() != 1 or p.dim() != 1 or s.shape != p.shape:
            raise ValueError(
                f"TokenLayout wants two 1-D tensors of one length, got {tuple(s.shape)} and {tuple(p.shape)}"
            )
        if s.dtype != _I64 or p.dtype != _I64 or s.device.type != "cpu" or p.device.type != "cpu":
            raise ValueError(
                f"TokenLayout wants int64 CPU tensors, got {s.dtype}/{s.device} and {p.dtype}/{p.device}"
            )
        pad_s, pad_p = s < 0, p < 0
        if not torch.equal(pad_s, pad_p) or bool((s < -1).any()) or bool((p < -1).any()):
            raise ValueError("TokenLayout: padding rows must have sample_id == position == -1")

    def __getattr__(self, name: str) -> Any:
        # a layout built from its runs (packed_layouts) makes its row tensors on first use
        rows = self.__dict__.get("_rows")
        if rows is None or name not in ("sample_id_R", "position_R"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        sample_id_R, position_R = rows()
        object.__setattr__(self, "sample_id_R", sample_id_R)
        object.__setattr__(self, "position_R", position_R)
        self.__dict__.pop("_rows", None)
        return self.__dict__[name]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if "_rows" in state:  # the rows themselves, not how to make them
            state["sample_id_R"], state["position_R"] = self.sample_id_R, self.position_R
            del state["_rows"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def num_rows(self) -> int:
        """Rows of the local buffer (padding included)."""
        n = self.__dict__.get("_num_rows")
        return int(self.sample_id_R.numel()) if n is None else n

    @property
    def num_tokens(self) -> int:
        """Rows that hold a real token."""
        return int((self.sample_id_R >= 0).sum())

    def digest(self) -> str:
        """A short content hash (for plan caching and messages)."""
        return Digest(self.sample_id_R, self.position_R, size=12).hexdigest()

    def same_as(self, other: TokenLayout) -> bool:
        """True if both layouts map every row to the same key."""
        return torch.equal(self.sample_id_R, other.sample_id_R) and torch.equal(
            self.position_R, other.position_R
        )


def encode_keys(sample_id_R: torch.Tensor, position_R: torch.Tensor, stride: int) -> torch.Tensor:
    """``[R]`` int64 keys ``sample_id * stride + position``; ``-1`` where the row is padding.

    Readable keys for small ids (tests, tools). A real row whose key would not fit int64 is a
    ``ValueError``, never a wrapped key; :func:`token_keys` compares tokens of any sample id.
    """
    real = sample_id_R >= 0
    if bool(real.any()):
        top = int(sample_id_R[real].max())
        if top > (2**63 - 1 - max(int(position_R[real].max()), 0)) // max(stride, 1):
            raise ValueError(
                f"encode_keys: sample id {top} * stride {stride} + position overflows int64; "
                "use token_keys"
            )
    return torch.where(real, sample_id_R * stride + position_R, torch.full_like(sample_id_R, -1))


def token_keys(
    sample_ids: Sequence[torch.Tensor], positions: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Keys of the tokens of several ``[R_k]`` row sets, equal exactly when two rows hold the
    same ``(sample_id, position)``, for every int64 sample id.

    ``index * stride + position``, where ``index`` is the sample id's place among the distinct
    ids of all the sets and ``stride`` is one past the largest position (no product of an id:
    a sample id near ``2**63`` cannot wrap into another's key). ``-1`` where a row is padding
    (``sample_id < 0``). Returns one ``[R_k]`` int64 tensor per set, on the CPU.
    """
    sids = [s.reshape(-1).cpu() for s in sample_ids]
    pos = [p.reshape(-1).cpu() for p in positions]
    real = [s >= 0 for s in sids]
    every = torch.cat([s[m] for s, m in zip(sids, real, strict=True)]) if sids else None
    if every is None or every.numel() == 0:
        return [torch.full_like(s, -1) for s in sids]
    ids = torch.unique(every)  # sorted
    stride = max(int(p[m].max()) for p, m in zip(pos, real, strict=True) if bool(m.any())) + 1
    if ids.numel() * stride >= 2**62:
        raise ValueError(f"{ids.numel()} samples with positions up to {stride} overflow int64 keys")
    out = []
    for s, p, m in zip(sids, pos, real, strict=True):
        index = torch.searchsorted(ids, s.clamp(min=0))
        out.append(torch.where(m, index * stride + p, torch.full_like(s, -1)))
    return out


def megatron_padded_length(length: int, *, cp_size: int = 1, sp_size: int = 1) -> int:
    """Megatron's padded length of a packed (THD) sequence: a multiple of ``2 * cp`` under
    context parallelism, times ``sp`` (the TP size when sequence parallelism is on)."""
    mult = (2 * cp_size if cp_size > 1 else 1) * sp_size
    return -(-int(length) // mult) * mult


def cp_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """``[seq_len / cp]`` positions CP rank ``cp_rank`` holds of a sequence of ``seq_len``.

    Chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks.
    """
    if seq_len % (2 * cp_size) and cp_size > 1:
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp_size} (context parallelism)"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return torch.arange(seq_len, dtype=_I64)
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, dtype=_I64)
    j = 2 * cp_size - 1 - cp_rank
    second = torch.arange(j * chunk, (j + 1) * chunk, dtype=_I64)
    return torch.cat([first, second])


def _sp_bounds(
    n_B: np.ndarray, sp_size: int, sp_rank: int, what: Callable[[int], str]
) -> tuple[np.ndarray, np.ndarray]:
    """``([B] lo, [B] hi)``: SP rank ``sp_rank``'s rows of each of ``B`` local lengths split
    into ``sp_size`` equal slices; a ``ValueError`` naming ``what(b)`` of the first that does
    not split."""
    if sp_size < 1 or not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} outside [0, {sp_size})")
    uneven = (n_B % sp_size).nonzero()[0]
    if uneven.size:
        b = int(uneven[0])
        raise ValueError(
            f"{what(b)} {int(n_B[b])} is not divisible by the sequence-parallel size {sp_size}"
        )
    per_B = n_B // sp_size
    return sp_rank * per_B, (sp_rank + 1) * per_B


def padded_layout(
    sample_ids: Sequence[int] | torch.Tensor,
    seq_len: int,
    *,
    order: Literal["sbh", "bsh"] = "sbh",
    lengths: Sequence[int] | torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> TokenLayout:
    """Layout of a padded batch ``[S_local, B, H]`` (``sbh``) or ``[B, S_local, H]`` (``bsh``).

    Args:
        sample_ids: ``[B]`` global sample ids of the batch columns.
        seq_len: the padded sequence length ``S`` (before CP / SP).
        lengths: ``[B]`` real lengths; positions at or past them are padding (default: all real).
        cp_size, cp_rank: context parallelism (zigzag, ``S % (2 * cp) == 0``).
        sp_size, sp_rank: sequence parallelism over the local sequence dim (``S_local = S / cp / sp``).
    """
    sample_B = torch.as_tensor(sample_ids, dtype=_I64).reshape(-1)
    if bool((sample_B < 0).any()):
        raise ValueError(f"sample ids must be non-negative, got {sample_B.tolist()}")
    if order not in ("sbh", "bsh"):
        raise ValueError(f"order must be 'sbh' or 'bsh', got {order!r}")
    pos_S = cp_positions(seq_len, cp_size, cp_rank)
    lo, hi = _sp_bounds(
        np.asarray([pos_S.numel()]), sp_size, sp_rank, lambda b: "local sequence length"
    )
    pos_S = pos_S[int(lo[0]) : int(hi[0])]
    B, S = sample_B.numel(), pos_S.numel()
    if lengths is None:
        len_B = torch.full((B,), seq_len, dtype=_I64)
    else:
        len_B = torch.as_tensor(lengths, dtype=_I64).reshape(-1)
        if len_B.numel() != B or bool((len_B < 0).any()) or bool((len_B > seq_len).any()):
            raise ValueError(f"lengths {len_B.tolist()} must be {B} values in [0, {seq_len}]")
    if order == "sbh":
        s_R = sample_B.expand(S, B)
        p_R = pos_S[:, None].expand(S, B)
        valid = p_R < len_B[None, :]
    else:
        s_R = sample_B[:, None].expand(B, S)
        p_R = pos_S[None, :].expand(B, S)
        valid = p_R < len_B[:, None]
    minus = torch.full((), -1, dtype=_I64)
    layout = TokenLayout(
        sample_id_R=torch.where(valid, s_R, minus).reshape(-1).contiguous(),
        position_R=torch.where(valid, p_R, minus).reshape(-1).contiguous(),
    )
    sample_b, len_b = sample_B.numpy(), len_B.numpy()
    if np.unique(sample_b).size == B:  # else two columns interleave: the per-row path
        p0, s0, m = _pieces(pos_S.numpy())
        col = sample_b.argsort(kind="stable")
        # segments: columns in sample order, each column's pieces in position order
        p0_M = np.broadcast_to(p0, (B, p0.size)).reshape(-1)
        s0_M = np.broadcast_to(s0, (B, p0.size)).reshape(-1)
        b_M = col.repeat(p0.size)
        n_M = np.clip(len_b[b_M] - p0_M, 0, np.broadcast_to(m, (B, p0.size)).reshape(-1))
        if order == "sbh":
            row_M, step_M = s0_M * B + b_M, np.full(b_M.size, B, dtype=np.int64)
        else:
            row_M, step_M = b_M * S + s0_M, np.ones(b_M.size, dtype=np.int64)
        _attach_runs(layout, _segment_runs(sample_b[b_M], p0_M, row_M, step_M, n_M))
    return layout


def packed_layout(
    sample_ids: Sequence[int] | torch.Tensor,
    seq_lens: Sequence[int] | torch.Tensor,
    *,
    cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> TokenLayout:
    """Layout of packed sequences (THD; Megatron's ``[T_local, 1, H]``).

    Args:
        sample_ids: ``[N]`` global sample ids, in packing order.
        seq_lens: ``[N]`` real lengths.
        cu_seqlens_padded: ``[N + 1]`` padded offsets over the *global* (pre-CP) packed sequence;
            by default each length is rounded up to a multiple of ``2 * cp * sp`` (Megatron's
            padding under CP, times tp when SP is on; pass ``sp_size=tp`` then).
        cp_size, cp_rank: per-sequence zigzag; each padded length must divide ``2 * cp``.
        sp_size, sp_rank: split of the local ``T`` into ``sp`` slices.
    """
    return packed_layouts(
        [sample_ids],
        [seq_lens],
        cu_seqlens_padded=None if cu_seqlens_padded is None else [cu_seqlens_padded],
        cp_size=cp_size,
        cp_rank=cp_rank,
        sp_size=sp_size,
        sp_rank=sp_rank,
    )[0]


def packed_layouts(
    sample_ids: Sequence[Sequence[int] | torch.Tensor],
    seq_lens: Sequence[Sequence[int] | torch.Tensor],
    *,
    cu_seqlens_padded: Sequence[Sequence[int] | torch.Tensor] | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    sp_size: int = 1,
    sp_rank: int = 0,
) -> list[TokenLayout]:
    """:func:`packed_layout` of each of a step's micro-batches, built in one pass (the same
    layouts and runs; the fixed cost of a call paid once for the step, not per micro-batch).

    Args:
        sample_ids, seq_lens: per micro-batch, its ``[N_i]`` sample ids and real lengths.
        cu_seqlens_padded: per micro-batch, its ``[N_i + 1]`` padded offsets (see
            :func:`packed_layout`; by default Megatron's padding).
        cp_size, cp_rank, sp_size, sp_rank: this rank's, the same for every micro-batch.
    """
    n_mb = len(sample_ids)
    if len(seq_lens) != n_mb or (cu_seqlens_padded is not None and len(cu_seqlens_padded) != n_mb):
        raise ValueError(
            f"{n_mb} micro-batches of sample ids but {len(seq_lens)} of sequence lengths"
            + ("" if cu_seqlens_padded is None else f" and {len(cu_seqlens_padded)} of offsets")
        )
    if cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    where = (lambda k: "") if n_mb == 1 else (lambda k: f"micro-batch {k}: ")
    ids_B = [_ints(x) for x in sample_ids]
    lens_B = [_ints(x) for x in seq_lens]
    for k, (ids, lens) in enumerate(zip(ids_B, lens_B, strict=True)):
        if ids.size != lens.size:
            raise ValueError(f"{where(k)}{ids.size} sample ids but {lens.size} sequence lengths")
    count_B = np.fromiter((x.size for x in ids_B), dtype=np.int64, count=n_mb)
    sample_N = np.concatenate(ids_B) if n_mb else np.empty(0, dtype=np.int64)
    len_N = np.concatenate(lens_B) if n_mb else np.empty(0, dtype=np.int64)
    mb_N = np.arange(n_mb, dtype=np.int64).repeat(count_B)
    if sample_N.size and (int(sample_N.min()) < 0 or int(len_N.min()) < 0):
        k = int(mb_N[((sample_N < 0) | (len_N < 0)).ravel().nonzero()[0][0]])
        raise ValueError(f"{where(k)}sample ids and sequence lengths must be non-negative")
    if cu_seqlens_padded is None:
        mult = megatron_padded_length(1, cp_size=cp_size, sp_size=sp_size)  # the rule's multiple
        pad_N = (len_N + mult - 1) // mult * mult
    else:
        cu_B = [_ints(x) for x in cu_seqlens_padded]
        cu_C = np.concatenate(cu_B) if n_mb else np.empty(0, dtype=np.int64)
        first_C = (count_B + 1).cumsum() - (count_B + 1)  # each micro-batch's first offset
        sizes_ok = np.fromiter((c.size for c in cu_B), dtype=np.int64, count=n_mb) == count_B + 1
        bad = (
            (~sizes_ok).ravel().nonzero()[0]
            if not sizes_ok.all()
            else cu_C[first_C].ravel().nonzero()[0]
        )
        if bad.size:
            k = int(bad[0])
            raise ValueError(
                f"{where(k)}cu_seqlens_padded must be {count_B[k] + 1} offsets from 0, "
                f"got {cu_B[k].tolist()}"
            )
        off_N = np.arange(mb_N.size) + mb_N  # sequence n's offset (one more per micro-batch)
        pad_N = cu_C[off_N + 1] - cu_C[off_N]
        short = pad_N < len_N
        if bool(short.any()):
            k = int(mb_N[short.ravel().nonzero()[0][0]])
            raise ValueError(
                f"{where(k)}cu_seqlens_padded {_ints(cu_seqlens_padded[k]).tolist()} leaves "
                f"less room than seq_lens {lens_B[k].tolist()}"
            )
    if cp_size > 1:
        bad = pad_N % (2 * cp_size) != 0
        if bool(bad.any()):
            i = int(bad.ravel().nonzero()[0][0])
            k = int(mb_N[i])
            i_k = i - int(count_B[:k].sum())
            raise ValueError(
                f"{where(k)}packed sequence {i_k} (sample {int(sample_N[i])}) has padded length "
                f"{int(pad_N[i])}, not divisible by 2*cp = {2 * cp_size} (context parallelism)"
            )
    local_N = pad_N // cp_size
    chunk_N = pad_N // (2 * cp_size) if cp_size > 1 else pad_N
    first_B = count_B.cumsum() - count_B
    cum_N = np.concatenate([[0], local_N.cumsum()])
    local_B = cum_N[first_B + count_B] - cum_N[first_B]
    start_N = cum_N[:-1] - cum_N[first_B][mb_N]  # a sequence's first local row in its micro-batch
    # this SP rank's rows of each micro-batch
    lo_B, hi_B = _sp_bounds(local_B, sp_size, sp_rank, lambda k: f"{where(k)}local packed length")
    # a sample id twice in a micro-batch: its rows first, its runs from the rows (rare)
    key = np.lexsort((sample_N, mb_N))
    twice = np.zeros(n_mb, dtype=bool)
    same = (sample_N[key][1:] == sample_N[key][:-1]) & (mb_N[key][1:] == mb_N[key][:-1])
    twice[mb_N[key][1:][same]] = True
    out: list[TokenLayout | None] = [None] * n_mb
    for k in twice.ravel().nonzero()[0].tolist():
        at = slice(int(first_B[k]), int(first_B[k] + count_B[k]))
        out[k] = _packed_rows(
            sample_N[at],
            len_N[at],
            local_N[at],
            chunk_N[at],
            cp_size,
            cp_rank,
            slice(int(lo_B[k]), int(hi_B[k])),
        )
    if not twice.all():
        lo_B, hi_B = lo_B.copy(), hi_B.copy()
        lo_B[twice], hi_B[twice] = 0, 0  # built above: no pieces, no rows
        keep = ~twice[mb_N]
        if not keep.all():
            sample_N, len_N, chunk_N, start_N, mb_N = (
                x[keep] for x in (sample_N, len_N, chunk_N, start_N, mb_N)
            )
        built = _packed_unique(
            sample_N, len_N, chunk_N, start_N, mb_N, lo_B, hi_B, cp_size, cp_rank
        )
        for k, layout in enumerate(built):
            if out[k] is None:
                out[k] = layout
    return [x for x in out if x is not None]


def _packed_rows(
    sample_N: np.ndarray,
    len_N: np.ndarray,
    local_N: np.ndarray,
    chunk_N: np.ndarray,
    cp_size: int,
    cp_rank: int,
    sl: slice,
) -> TokenLayout:
    """One micro-batch's packed layout row by row (a sample id twice: runs from the rows,
    :func:`layout_to_runs`)."""
    n = torch.from_numpy(local_N)
    seq_T = torch.repeat_interleave(torch.arange(sample_N.size, dtype=_I64), n)
    starts = torch.cumsum(n, 0) - n
    j_T = torch.arange(seq_T.numel(), dtype=_I64) - starts[seq_T]
    if cp_size > 1:
        c_T = torch.from_numpy(chunk_N)[seq_T]
        second = j_T >= c_T
        pos_T = torch.where(
            second, (2 * cp_size - 1 - cp_rank) * c_T + (j_T - c_T), cp_rank * c_T + j_T
        )
    else:
        pos_T = j_T
    seq_T, pos_T = seq_T[sl], pos_T[sl]
    valid = pos_T < torch.from_numpy(len_N)[seq_T]
    minus = torch.full((), -1, dtype=_I64)
    return TokenLayout(
        sample_id_R=torch.where(valid, torch.from_numpy(sample_N)[seq_T], minus).contiguous(),
        position_R=torch.where(valid, pos_T, minus).contiguous(),
    )


def _ints(x: Sequence[int] | torch.Tensor) -> np.ndarray:
    """``x`` as a flat int64 NumPy array."""
    if isinstance(x, torch.Tensor):
        if x.dtype is _I64 and x.is_cpu and x.ndim == 1:
            return x.numpy()
        return x.detach().to(device="cpu", dtype=_I64).reshape(-1).numpy()
    return np.asarray(x, dtype=np.int64).reshape(-1)


def concat_layouts(layouts: Sequence[TokenLayout]) -> TokenLayout:
    """Layout of buffers stacked along rows (e.g. all micro-batches of a step, one after another)."""
    if not layouts:
        empty = torch.empty(0, dtype=_I64)
        return TokenLayout(sample_id_R=empty, position_R=empty.clone())
    return TokenLayout(
        sample_id_R=torch.cat([x.sample_id_R for x in layouts]),
        position_R=torch.cat([x.position_R for x in layouts]),
    )


def layout_to_runs(layout: TokenLayout) -> torch.Tensor:
    """``[K, 5]`` int64 runs ``(sample_id, position_start, row_start, row_step, length)``.

    Each run is rows ``row_start + i * row_step`` holding positions ``position_start + i``
    (``i < length``) of one sample. Padding rows are not listed. Vectorized; not always the
    fewest runs, always exact (:func:`layout_from_runs` inverts it). Runs are sorted by
    ``(sample_id, position_start)``. A layout from :func:`padded_layout` /
    :func:`packed_layout` returns the runs it was built with (the same table; do not modify).
    """
    built = layout.__dict__.get("_runs_K5")
    if built is not None:
        return built
    return _row_runs(layout)


def _row_runs(layout: TokenLayout) -> torch.Tensor:
    """:func:`layout_to_runs` from the rows: sort the keys, cut where a run ends."""
    s, p = layout.sample_id_R, layout.position_R
    row = torch.nonzero(s >= 0).reshape(-1)
    if row.numel() == 0:
        return torch.empty((0, 5), dtype=_I64)
    s, p = s[row], p[row]
    # (sample_id, position) order without a combined key (an id near 2**63 would wrap it)
    order = torch.argsort(p, stable=True)
    order = order[torch.argsort(s[order], stable=True)]
    s, p, row = s[order], p[order], row[order]
    n = row.numel()
    d = row[1:] - row[:-1]
    cont = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + 1)
    # Break before element i+1 when (i, i+1) is not continuous, or its step differs from (i-1, i)'s.
    step_change = torch.zeros(n - 1, dtype=torch.bool)
    if n > 2:
        step_change[1:] = cont[:-1] & (d[1:] != d[:-1])
    brk = ~cont | step_change
    start = torch.cat([torch.zeros(1, dtype=_I64), torch.nonzero(brk).reshape(-1) + 1])
    length = torch.diff(torch.cat([start, torch.tensor([n], dtype=_I64)]))
    step = torch.ones_like(start)
    multi = length > 1
    step[multi] = d[start[multi]]
    return torch.stack([s[start], p[start], row[start], step, length], dim=1)


def _attach_runs(layout: TokenLayout, runs_K5: np.ndarray | torch.Tensor) -> None:
    runs = torch.from_numpy(runs_K5) if isinstance(runs_K5, np.ndarray) else runs_K5
    object.__setattr__(layout, "_runs_K5", runs)


def _pieces(pos_S: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first position, first index, length)`` of each stretch of consecutive positions of
    ``pos_S``, in position order (CP chunks of a column)."""
    if pos_S.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, empty
    cut = (pos_S[1:] != pos_S[:-1] + 1).ravel().nonzero()[0] + 1
    start = np.concatenate([[0], cut]).astype(np.int64)
    length = np.diff(np.concatenate([start, [pos_S.size]])).astype(np.int64)
    order = pos_S[start].argsort(kind="stable")
    return pos_S[start][order], start[order], length[order]


_PAIR = np.asarray([0, 1], dtype=np.int64)


def _packed_unique(
    sample_N: np.ndarray,
    len_N: np.ndarray,
    chunk_N: np.ndarray,
    start_N: np.ndarray,
    mb_N: np.ndarray,
    lo_B: np.ndarray,
    hi_B: np.ndarray,
    cp_size: int,
    cp_rank: int,
) -> list[TokenLayout]:
    """The layouts of micro-batches of packed sequences of distinct sample ids, each its local
    rows ``[lo_B[k], hi_B[k])`` (the SP slice), built from their pieces (a CP chunk of a
    sequence, cut to the slice and to the real length) in a fixed number of array operations
    for every micro-batch together, each carrying its runs: those the per-row rule gives
    (every piece advances one row per position, so the per-row rule only joins a piece to the
    one before when it continues it in sample, position and row: the two chunks of a sequence
    on the middle CP rank). ``[N]`` arrays: every micro-batch's sequences one after another,
    ``mb_N`` a sequence's micro-batch, ``start_N`` its first local row in it."""
    n_mb = lo_B.size
    rows_B = hi_B - lo_B
    # a micro-batch's rows at this offset of one buffer holding every micro-batch's
    off_B = rows_B.cumsum() - rows_B
    # pieces in key order (micro-batch, samples ascending, a sequence's chunks in position order)
    seq = np.lexsort((sample_N, mb_N))
    c_N, len_N, mb_N = chunk_N[seq, None], len_N[seq, None], mb_N[seq, None]
    start_N = start_N[seq, None]
    if cp_size > 1:  # chunk cp_rank at the sequence's first rows, chunk 2 cp - 1 - cp_rank next
        rows = start_N + c_N * _PAIR
        first = c_N * np.asarray([cp_rank, 2 * cp_size - 1 - cp_rank], dtype=np.int64)
    else:
        rows, first = start_N, np.zeros_like(start_N)
    lo, hi = lo_B[mb_N], hi_B[mb_N]
    a = np.maximum(rows, lo)
    pos = first + (a - rows)
    n_M = np.minimum(np.minimum(rows + c_N, hi) - a, len_N - pos).reshape(-1)
    keep = n_M > 0  # empty pieces dropped
    n_M = n_M[keep]
    s_M = sample_N[seq].repeat(rows.shape[1])[keep]
    b_M = mb_N[:, 0].repeat(rows.shape[1])[keep]
    p_M = pos.reshape(-1)[keep]
    r_M = (a - lo).reshape(-1)[keep]  # rows within the micro-batch
    total = int(rows_B.sum())
    m = n_M.size
    runs = np.empty((0, 5), dtype=np.int64)
    run_b = np.empty(0, dtype=np.int64)
    seg = np.zeros((3, 1), dtype=np.int64)  # per stretch of rows: count, sample, position - row
    seg[0, 0], seg[1, 0] = total, -1  # no pieces: every row padding
    if m:
        new = np.ones(m, dtype=bool)
        new[1:] = (b_M[1:] != b_M[:-1]) | (s_M[1:] != s_M[:-1]) | (p_M[1:] != p_M[:-1] + n_M[:-1])
        assert bool((new[1:] | (r_M[1:] == r_M[:-1] + n_M[:-1])).all()), "a piece jumps rows"
        at = new.nonzero()[0]
        runs = np.ones((at.size, 5), dtype=np.int64)
        runs[:, 0], runs[:, 1], runs[:, 2] = s_M[at], p_M[at], r_M[at]
        runs[:, 4] = np.add.reduceat(n_M, at)
        run_b = b_M[at]
        # the pieces in row order (of the one buffer), padding around them
        g_M = r_M + off_B[b_M]
        o = g_M.argsort(kind="stable")
        r_o, n_o = g_M[o], n_M[o]
        seg = np.empty((3, 2 * m + 1), dtype=np.int64)
        seg[:, 1::2] = n_o, s_M[o], p_M[o] - r_o
        seg[0, 2:-1:2] = r_o[1:] - r_o[:-1] - n_o[:-1]
        seg[0, 0], seg[0, -1] = r_o[0], total - r_o[-1] - n_o[-1]
        seg[1, 0::2], seg[2, 0::2] = -1, 0
    cut_R = [0, *off_B[1:].tolist(), total]
    cut_K = [0, *run_b.searchsorted(np.arange(1, n_mb)).tolist(), run_b.size]
    runs_T = torch.from_numpy(runs)
    made: list[tuple[torch.Tensor, torch.Tensor]] = []

    def all_rows() -> tuple[torch.Tensor, torch.Tensor]:
        """Every micro-batch's rows in one buffer (made once, when a layout's are first read)."""
        if not made:
            sample_R = seg[1].repeat(seg[0])
            pos_R = seg[2].repeat(seg[0])
            pos_R += np.arange(total)
            pos_R[sample_R < 0] = -1
            made.append((torch.from_numpy(sample_R), torch.from_numpy(pos_R)))
        return made[0]

    out = []
    for k in range(n_mb):
        layout = TokenLayout.__new__(TokenLayout)  # valid by construction: skip the row checks
        lo, hi = cut_R[k], cut_R[k + 1]
        object.__setattr__(
            layout, "_rows", lambda lo=lo, hi=hi: tuple(x[lo:hi] for x in all_rows())
        )
        object.__setattr__(layout, "_num_rows", hi - lo)
        _attach_runs(layout, runs_T[cut_K[k] : cut_K[k + 1]])
        out.append(layout)
    return out


def _segment_runs(
    sample_M: np.ndarray,
    pos_M: np.ndarray,
    row_M: np.ndarray,
    step_M: np.ndarray,
    n_M: np.ndarray,
) -> np.ndarray:
    """The runs :func:`_row_runs` gives for tokens that, sorted by key, are these segments one
    after another: segment ``m`` holds positions ``pos_M[m] + i`` of ``sample_M[m]`` at rows
    ``row_M[m] + i * step_M[m]`` (``i < n_M[m]``; empty ones are dropped). Only the segment
    ends need deciding: the per-row rule cuts between tokens ``t`` and ``t + 1`` when they
    are not consecutive positions of one sample, or when the pair before was and had another
    row step; inside a segment neither happens."""
    keep = n_M > 0
    s, p, r, st, n = (x[keep].astype(np.int64) for x in (sample_M, pos_M, row_M, step_M, n_M))
    m = n.size
    if m == 0:
        return np.empty((0, 5), dtype=np.int64)
    last_row = r + (n - 1) * st
    # boundary k (k >= 1): the pair (last token of segment k - 1, first of segment k)
    cont = np.zeros(m, dtype=bool)
    d = np.zeros(m, dtype=np.int64)
    cont[1:] = (s[1:] == s[:-1]) & (p[1:] == p[:-1] + n[:-1])
    d[1:] = r[1:] - last_row[:-1]
    # the pair before boundary k: inside segment k - 1 (n >= 2), else boundary k - 1
    prev_cont = np.zeros(m, dtype=bool)
    prev_d = np.zeros(m, dtype=np.int64)
    inner = np.zeros(m, dtype=bool)
    inner[1:] = n[:-1] >= 2
    prev_cont[1:] = np.where(inner[1:], True, cont[:-1])
    prev_d[1:] = np.where(inner[1:], st[:-1], d[:-1])
    cut_at = ~cont | (prev_cont & (d != prev_d))
    cut_at[0] = True
    # the pair (first, second token of segment k), k >= 1: its previous pair is boundary k
    cut_next = (n >= 2) & cont & (d != st)
    cut_next[0] = False
    off = n.cumsum() - n
    starts = np.stack([np.where(cut_at, off, -1), np.where(cut_next, off + 1, -1)], axis=1)
    starts = starts.reshape(-1)
    starts = starts[starts >= 0]
    total = int(n.sum())
    length = np.diff(np.concatenate([starts, [total]]))
    seg = off.searchsorted(starts, side="right") - 1
    j = starts - off[seg]
    step = np.ones(starts.size, dtype=np.int64)
    multi = length > 1
    inside = j < n[seg] - 1
    nxt = np.minimum(seg + 1, m - 1)
    step[multi] = np.where(inside, st[seg], d[nxt])[multi]
    return np.stack([s[seg], p[seg] + j, r[seg] + j * st[seg], step, length], axis=1)


def layout_from_runs(runs_K5: torch.Tensor, num_rows: int) -> TokenLayout:
    """Invert :func:`layout_to_runs`: the layout of ``num_rows`` rows described by ``runs_K5``."""
    sample_R = torch.full((num_rows,), -1, dtype=_I64)
    pos_R = torch.full((num_rows,), -1, dtype=_I64)
    if runs_K5.numel():
        length = runs_K5[:, 4]
        k = torch.repeat_interleave(torch.arange(runs_K5.shape[0], dtype=_I64), length)
        i = torch.arange(k.numel(), dtype=_I64) - (torch.cumsum(length, 0) - length)[k]
        rows = runs_K5[k, 2] + i * runs_K5[k, 3]
        if int(rows.min()) < 0 or int(rows.max()) >= num_rows:
            raise ValueError(f"layout runs name rows outside [0, {num_rows})")
        sample_R[rows] = runs_K5[k, 0]
        pos_R[rows] = runs_K5[k, 1] + i
    return TokenLayout(sample_id_R=sample_R, position_R=pos_R)
