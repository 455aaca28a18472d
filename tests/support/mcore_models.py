"""Small GPTModels for the training-loop tests: a full (TP1, PP1) one and its shards on a mesh.

Why this file exists: the tier-2 loop tests compare a distributed MOPD step with the plain
computation on the same weights. Each needs the same two builders: a full model with fixed
weights, the same on every rank, and this rank's stage and TP shard of it on a mesh (the full
weights copied in, :func:`tests.support.mcore_ref.load_sharded`), with learned absolute positions
so the reference needs no positional trick.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tests.support.mcore_ref import load_sharded
from tests.support.megatron_cpu import tiny_config

__all__ = ["full_gpt", "sharded_gpt"]


def _gpt(cfg: Any, spec: Any, *, vocab: int, seq: int, pre: bool, post: bool, pg: Any) -> Any:
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="learned_absolute",
        pre_process=pre,
        post_process=post,
        pg_collection=pg,
    )


def full_gpt(
    *, hidden: int, seed: int, vocab: int, seq: int, layers: int, **config: Any
) -> tuple[Any, dict[str, torch.Tensor]]:
    """A TP1, PP1 GPTModel (local layer spec, init std 0.05) seeded with ``seed``, and a copy
    of its full weights by parameter name."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    cfg = tiny_config(num_layers=layers, hidden_size=hidden, init_method_std=0.05, **config)
    model = _gpt(
        cfg, get_gpt_layer_local_spec(), vocab=vocab, seq=seq, pre=True, post=True, pg=None
    )
    return model, {n: p.detach().clone() for n, p in model.named_parameters()}


def sharded_gpt(
    mesh: Any,
    pg: Any,
    full: dict[str, torch.Tensor],
    *,
    hidden: int,
    sp: bool,
    thd: bool,
    vocab: int,
    seq: int,
    layers: int,
    **config: Any,
) -> tuple[Any, dict[str, str], Any]:
    """This rank's stage and TP shard of the model whose full weights are ``full``, on
    ``mesh`` with its groups ``pg`` (``thd``: the CPU core attention, for THD / CP).
    Returns ``(model, parameter name -> full name, config)``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mopd.mcore.cpu import cpu_gpt_layer_spec

    c = mesh.coord(dist.get_rank())
    cfg = tiny_config(
        num_layers=layers,
        hidden_size=hidden,
        tensor_model_parallel_size=mesh.tp,
        pipeline_model_parallel_size=mesh.pp,
        context_parallel_size=mesh.cp,
        sequence_parallel=sp,
        **config,
    )
    spec = cpu_gpt_layer_spec() if thd else get_gpt_layer_local_spec()
    model = _gpt(
        cfg, spec, vocab=vocab, seq=seq, pre=c.pp_rank == 0, post=c.pp_rank == mesh.pp - 1, pg=pg
    )
    names = load_sharded(
        model, full, tp_rank=c.tp_rank, tp_size=mesh.tp, layer_offset=c.pp_rank * layers // mesh.pp
    )
    return model, names, cfg
