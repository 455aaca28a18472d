"""The student samples its own responses, under its own TP/CP/PP: ``mopd demo``'s rollouts.

Why this file exists: on-policy distillation trains the student on the responses it samples
itself, so the demo needs a sampler that runs on the student's mesh, as a trainer's rollout
engine would. It is tool code, the demo's: the library's data path (capture, bridge, kernels,
mcore) never imports it. Plain forward passes, no KV cache: each new token is one forward of
the whole prefix, through megatron's forward-only schedule (:func:`generate`), which runs the
pipeline stages of a PP student as training does.

How the ranks of one student DP replica (its TP x CP x PP ranks) agree on every token: on the
last stage, the logit row of each sequence's last real position is read on the CP rank that
holds it (CP zigzag) and all-gathered over the CP group, then the vocab-parallel row is
all-gathered over the TP group (:func:`last_position_logits`): every last-stage rank then holds
the same bits, and picks the same token from the same noise; earlier stages get the tokens by a
broadcast over their PP group. :func:`check_copies_agree` checks that (one all-gather of every
rank's copy of every response, judged alike on every rank by :func:`judge_copies`); it moves no
rollout: one rank of each replica hands its samples to the library as
:class:`~mopd.mcore.Rollouts` (``Distiller.step`` sends the token ids where they are used).

Determinism: temperature sampling by the Gumbel-max rule, ``argmax(logits / T + g)``, with the
noise ``g`` drawn from a generator seeded by ``(seed, stream, sample id)`` (:func:`gumbel_noise`,
row ``t`` for the sample's ``t``-th new token). A sample's tokens thus depend on its id and its
logits only: not on the replica that sampled it, the batch it sat in, or the rank count; two
meshes sample the same tokens wherever their logits agree up to float reordering (unless two
candidates tie within that noise).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mopd.common import dist as cdist
from mopd.mcore import MicroBatch, padded_micro_batch

__all__ = [
    "SamplingConfig",
    "check_copies_agree",
    "choose_tokens",
    "generate",
    "gumbel_noise",
    "judge_copies",
    "last_position_logits",
]


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How responses are sampled.

    Attributes:
        max_new_tokens: at most this many response tokens per sample.
        temperature: the student's logits are divided by it (``> 0``; 1 samples the student's
            own distribution).
        stop_token: a response ends with this token (which it keeps), or ``None``.
        vocab_size: the real vocabulary (columns past it are never sampled).
        seed, stream: with each sample id, the seed of its noise; ``stream`` keeps sets of
            samples whose ids overlap (a held-out set, the training rollouts) independent.
    """

    max_new_tokens: int
    temperature: float = 1.0
    stop_token: int | None = None
    vocab_size: int
    seed: int = 0
    stream: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.stop_token is not None and not 0 <= self.stop_token < self.vocab_size:
            raise ValueError(
                f"stop_token {self.stop_token} is outside the vocabulary [0, {self.vocab_size})"
            )


def gumbel_noise(
    sample_id: int, *, seed: int, stream: int, rows: int, vocab_size: int
) -> torch.Tensor:
    """``[rows, vocab_size]`` float64 standard Gumbel noise of one sample, from a generator
    seeded by ``(seed, stream, sample_id)`` (row ``t``: the sample's ``t``-th new token)."""
    key = zlib.crc32(f"{seed}/{stream}/{sample_id}".encode())
    g = torch.Generator().manual_seed(key)
    u = torch.rand(rows, vocab_size, generator=g, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp(min=1e-300)))


def choose_tokens(
    logits_BV: torch.Tensor, noise_BV: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``[B]`` int64: a token per row drawn from ``softmax(logits_BV / temperature)`` by the
    Gumbel-max rule (``argmax(logits / T + noise)``, in float64, on the CPU)."""
    scores = logits_BV.detach().cpu().to(torch.float64) / temperature + noise_BV
    return scores.argmax(dim=-1)


def _all_gather(x: torch.Tensor, group: Any, timeout_s: float | None) -> torch.Tensor:
    """``[n, *x.shape]``: ``x`` of every rank of ``group``, in group-rank order."""
    n = dist.get_world_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    work = cdist.all_gather_into(out, x.contiguous(), group=group, async_op=True)
    cdist.wait(work, device=x.device, timeout_s=timeout_s)
    return out.view(n, *x.shape)


def last_position_logits(
    logits_BSV: torch.Tensor,
    positions_B: torch.Tensor,
    position_ids_S: torch.Tensor,
    *,
    cp_group: Any | None,
    tp_group: Any | None,
    vocab_size: int,
    timeout_s: float | None,
) -> torch.Tensor:
    """The full-vocabulary logit row of one position per sequence, the same bits on every rank.

    Collective over the CP group, then the TP group (call it on every last-stage rank of the
    replica). Each row is read on the one CP rank whose zigzag chunks hold it (the others send
    zeros and a flag saying so), and the vocab slices are concatenated in TP-rank order
    (megatron's vocab partition): copies, no arithmetic, so every rank ends with equal bits.

    Args:
        logits_BSV: ``[B, S_local, V_local]`` this rank's logits (megatron's padded output).
        positions_B: ``[B]`` int64 the global position whose row each sequence wants.
        position_ids_S: ``[S_local]`` the global position of each local row (CP zigzag).
        vocab_size: the real vocabulary (padded columns are dropped).
    Returns:
        ``[B, vocab_size]`` fp32 on the logits' device.
    """
    B, _, v_local = logits_BSV.shape
    dev = logits_BSV.device
    hit_BS = position_ids_S.to(dev)[None, :] == positions_B.to(dev)[:, None]
    held_B = hit_BS.any(dim=1)
    local_B = hit_BS.to(torch.int64).argmax(dim=1)
    rows_BV = logits_BSV[torch.arange(B, device=dev), local_B].float()
    rows_BV = torch.where(held_B[:, None], rows_BV, torch.zeros((), device=dev))
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        flagged = torch.cat([rows_BV, held_B[:, None].float()], dim=1)
        every = _all_gather(flagged, cp_group, timeout_s)  # [cp, B, V_local + 1]
        held_CB = every[..., -1] > 0
        assert bool((held_CB.sum(0) == 1).all()), "each position lies on exactly one CP rank"
        rows_BV = every[held_CB.to(torch.int64).argmax(0), torch.arange(B, device=dev), :v_local]
    else:
        assert bool(held_B.all()), "without CP this rank holds every position"
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        shards = _all_gather(rows_BV, tp_group, timeout_s)  # [tp, B, V_local]
        rows_BV = shards.permute(1, 0, 2).reshape(B, -1)
    return rows_BV[:, :vocab_size].contiguous()


def _forward_logits(
    model: Any, mb: MicroBatch, *, pg_collection: Any, forward: Callable[[Any, MicroBatch], Any]
) -> torch.Tensor | None:
    """The model's output for one padded micro-batch through megatron's forward-only schedule:
    the logits on the last stage, ``None`` elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    got: dict[str, torch.Tensor] = {}

    def forward_step(data_iterator: Any, chunk: Any) -> tuple[Any, Any]:
        out = forward(chunk, next(data_iterator))

        def keep(output: torch.Tensor, non_loss_data: bool = False) -> tuple[Any, Any]:
            got["logits"] = output
            return output.new_zeros(()), {}

        return out, keep

    pp = pg_collection.pp.size()
    kwargs: dict[str, Any] = {"pg_collection": pg_collection}
    if pp > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(
            pp_group=pg_collection.pp, config=get_model_config(model)
        )
    assert mb.tokens is not None and mb.seq_len is not None
    with torch.no_grad():
        get_forward_backward_func(pp_size=pp, vp_size=None)(
            forward_step_func=forward_step,
            data_iterator=iter([mb]),
            model=[model],
            num_microbatches=1,
            seq_length=mb.seq_len,
            micro_batch_size=int(mb.tokens.shape[0]),
            forward_only=True,
            **kwargs,
        )
    return got.get("logits")


def generate(
    model: Any,
    prompts: Sequence[torch.Tensor],
    sample_ids: Sequence[int],
    *,
    pg_collection: Any,
    config: SamplingConfig,
    max_len: int,
    device: torch.device,
    forward: Callable[[Any, MicroBatch], Any] | None = None,
    timeout_s: float | None = 300.0,
) -> list[torch.Tensor]:
    """Sample a response to each prompt from ``model`` (collective over the replica's TP, CP
    and PP groups: every rank of one DP replica calls it with the same prompts).

    Each new token is one forward of the unfinished sequences, right-padded to a multiple of
    ``2 * cp`` (causal attention: padding after a row never reaches it), through megatron's
    forward-only schedule; the last stage picks the tokens (:func:`last_position_logits`,
    :func:`choose_tokens`) and broadcasts them over the PP group. A sequence ends at
    ``config.stop_token`` or after ``config.max_new_tokens`` tokens.

    Args:
        model: the (wrapped) student model of this rank (one pipeline stage).
        prompts: ``[P_i]`` int64 token ids per sequence (on the CPU).
        sample_ids: one global id per prompt (seeds its noise, with ``config.seed``/``stream``).
        pg_collection: the model's megatron ``ProcessGroupCollection``.
        max_len: the model's longest sequence (its position embeddings).
        forward: ``forward(model, micro_batch)`` (default: a GPTModel call).
    Returns:
        One ``[R_i]`` int64 CPU tensor per prompt (``1 <= R_i <= max_new_tokens``), the same on
        every rank of the replica.
    Raises:
        ValueError: an empty prompt, or a prompt plus ``max_new_tokens`` longer than
            ``max_len`` or than its padded multiple allows (before any communication).
    """
    from mopd.mcore.teacher import default_forward

    if len(prompts) != len(sample_ids):
        raise ValueError(f"{len(prompts)} prompts but {len(sample_ids)} sample ids")
    cp = pg_collection.cp.size()
    mult = 2 * cp if cp > 1 else 1
    longest = max((int(p.numel()) for p in prompts), default=0) + config.max_new_tokens - 1
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if -(-longest // mult) * mult > max_len:
        raise ValueError(
            f"a prompt of up to {longest - config.max_new_tokens + 1} tokens plus "
            f"{config.max_new_tokens} new ones needs forwards of {-(-longest // mult) * mult} "
            f"positions (a multiple of {mult}), past the model's {max_len}"
        )
    forward = forward or default_forward
    tp_group, cp_group, pp_group = pg_collection.tp, pg_collection.cp, pg_collection.pp
    last_stage = pp_group.rank() == pp_group.size() - 1
    seqs = [p.reshape(-1).to(torch.int64).cpu() for p in prompts]
    start = [int(s.numel()) for s in seqs]
    noise = [
        gumbel_noise(
            int(i),
            seed=config.seed,
            stream=config.stream,
            rows=config.max_new_tokens,
            vocab_size=config.vocab_size,
        )
        for i in sample_ids
    ]
    done = [False] * len(seqs)
    for t in range(config.max_new_tokens):
        active = [b for b in range(len(seqs)) if not done[b]]
        if not active:
            break
        lens = [int(seqs[b].numel()) for b in active]
        S = -(-max(lens) // mult) * mult
        tokens_BS = torch.zeros(len(active), S, dtype=torch.int64)
        for row, b in enumerate(active):
            tokens_BS[row, : lens[row]] = seqs[b]
        mb = padded_micro_batch(
            [int(sample_ids[b]) for b in active],
            tokens_BS,
            lengths=lens,
            cp_size=cp,
            cp_rank=cp_group.rank(),
            device=device,
        )
        logits = _forward_logits(model, mb, pg_collection=pg_collection, forward=forward)
        new_B = torch.empty(len(active), dtype=torch.int64)
        if last_stage:
            assert logits is not None and mb.position_ids is not None
            rows_BV = last_position_logits(
                logits,
                torch.tensor(lens, dtype=torch.int64) - 1,
                mb.position_ids[0],
                cp_group=cp_group,
                tp_group=tp_group,
                vocab_size=config.vocab_size,
                timeout_s=timeout_s,
            )
            noise_BV = torch.stack([noise[b][t] for b in active])
            new_B = choose_tokens(rows_BV, noise_BV, config.temperature)
        if pp_group.size() > 1:
            buf = new_B.to(device)
            src = dist.get_global_rank(pp_group, pp_group.size() - 1)
            work = dist.broadcast(buf, src=src, group=pp_group, async_op=True)
            cdist.wait(work, device=buf.device, timeout_s=timeout_s)
            new_B = buf.cpu()
        for row, b in enumerate(active):
            token = int(new_B[row])
            seqs[b] = torch.cat([seqs[b], new_B[row : row + 1]])
            if token == config.stop_token:
                done[b] = True
    return [s[n:] for s, n in zip(seqs, start, strict=True)]


def check_copies_agree(
    local: Mapping[int, torch.Tensor],
    sample_ids: Sequence[int],
    *,
    max_new_tokens: int,
    device: torch.device,
    timeout_s: float | None = 300.0,
) -> None:
    """Check that every copy of every response is the same, and that each was sampled.

    Collective over the default group: each rank passes the responses it sampled (every rank
    of a replica holds its replica's; a rank outside the student passes none). One all-gather
    of a ``[N, 1 + max_new_tokens]`` int64 table per rank (length, then tokens; ``-1`` where
    the rank holds no copy), judged by :func:`judge_copies` alike on every rank.

    Raises:
        ValueError: (the same on every rank) a sample no rank sampled, or whose copies differ.
    """
    index = {int(s): k for k, s in enumerate(sample_ids)}
    table_NC = torch.full((len(index), 1 + max_new_tokens), -1, dtype=torch.int64)
    for s, r in local.items():
        n = int(r.numel())
        assert int(s) in index and 1 <= n <= max_new_tokens, f"sample {s}: {n} tokens"
        table_NC[index[int(s)], 0] = n
        table_NC[index[int(s)], 1 : 1 + n] = r.reshape(-1).cpu()
    every_WNC = _all_gather(table_NC.to(device), None, timeout_s).cpu()
    judge_copies(every_WNC, list(index))


def judge_copies(every_WNC: torch.Tensor, sample_ids: Sequence[int]) -> dict[int, torch.Tensor]:
    """The agreed response of each sample from every rank's table (collective-free).

    Args:
        every_WNC: ``[world, N, 1 + R]`` int64: per global rank and sample (in ``sample_ids``
            order) the response length then its tokens, or ``-1`` where the rank has no copy.
    Returns:
        ``sample id -> [length]`` int64.
    Raises:
        ValueError: naming every sample no rank holds, and every one whose copies differ
            (with the ranks that disagree with its first holder).
    """
    out: dict[int, torch.Tensor] = {}
    problems = []
    for k, s in enumerate(sample_ids):
        held = (every_WNC[:, k, 0] >= 0).nonzero().reshape(-1).tolist()
        if not held:
            problems.append(f"sample {s}: no rank sampled it")
            continue
        first = every_WNC[held[0], k]
        differ = [r for r in held if not torch.equal(every_WNC[r, k], first)]
        if differ:
            problems.append(
                f"sample {s}: global ranks {differ} hold other tokens than global rank {held[0]}"
            )
            continue
        out[int(s)] = first[1 : 1 + int(first[0])].clone()
    if problems:
        raise ValueError("the student's ranks disagree on the rollouts: " + "; ".join(problems))
    return out
