"""Test builders for real megatron-core GPTModels and HybridModels on CPU ranks (gloo).

Why this file exists: tier-2 tests build many small models and compare sharded results with
full (TP=1) ones. The CPU patches megatron needs ship with the package (:mod:`mopd.mcore.cpu`,
applied by the harness and by :func:`build_gpt`); this module adds only what tests need on top:
tiny configs, model builders, and gathering / loading full parameter states.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mopd.mcore.cpu import apply

__all__ = [
    "apply",
    "build_gpt",
    "build_hybrid",
    "destroy_parallel",
    "full_state",
    "gather_vocab_shards",
    "hybrid_missing",
    "init_parallel",
    "load_full_state",
    "megatron_world",
    "tiny_config",
]


def init_parallel(
    *, tp: int = 1, pp: int = 1, cp: int = 1, vpp: int | None = None, seed: int = 1234
) -> None:
    """(Re)initialize megatron's parallel_state over the current world, and its RNG tracker."""
    apply()  # first: megatron-core imported with its fusions plain (mopd.mcore.cpu)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=2,
    )
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def megatron_world() -> Iterator[None]:
    """A module fixture's body for megatron on this torchrun world (gloo): the CPU patches, a
    TP=PP=1 ``parallel_state`` (the models under test take explicit ``pg_collection`` groups)
    and megatron's RNG tracker seeded; ``parallel_state`` is torn down afterwards."""
    apply()  # first: megatron-core imported with its fusions plain (mopd.mcore.cpu)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.support.dist import ensure_world

    ensure_world()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(7)
    yield
    parallel_state.destroy_model_parallel()


def tiny_config(**overrides: Any):
    """A small float32 TransformerConfig that runs on CPU."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(
    config: Any,
    *,
    vocab_size: int = 64,
    max_seq_len: int = 32,
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    vp_stage: int | None = None,
    position_embedding_type: str = "learned_absolute",
    mtp: bool = False,
    layer_spec: Any = None,
    pg_collection: Any = None,
):
    """A megatron-core GPTModel with the local (non-TE) layer spec.

    ``layer_spec`` replaces the local spec (e.g. ``mopd.mcore.cpu.cpu_gpt_layer_spec()``
    for CP / THD packing); ``pg_collection`` (a megatron ``ProcessGroupCollection``) builds the
    model on explicit process groups instead of megatron's global ``parallel_state`` ones.
    """
    apply()  # first: megatron-core imported with its fusions plain (mopd.mcore.cpu)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec() if layer_spec is None else layer_spec
    extra: dict[str, Any] = {}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    if mtp:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        extra["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    if vp_stage is not None:
        extra["vp_stage"] = vp_stage
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type=position_embedding_type,
        **extra,
    )


def hybrid_missing() -> str | None:
    """Why megatron-core's ``HybridModel`` cannot be built here (a skip reason), or ``None``."""
    import importlib.util
    from importlib import metadata

    try:
        found = importlib.util.find_spec("megatron.core.models.hybrid") is not None
    except ModuleNotFoundError:  # no megatron at all
        found = False
    if found:
        return None
    try:
        have = f"megatron-core {metadata.version('megatron-core')}"
    except metadata.PackageNotFoundError:
        have = "no megatron-core"
    return (
        f"{have} has no megatron.core.models.hybrid (HybridModel is in 0.18+; "
        "`make test-newest` runs these tests on 0.19.x)"
    )


def build_hybrid(
    config: Any,
    *,
    pattern: str,
    vocab_size: int = 64,
    max_seq_len: int = 32,
    pre_process: bool = True,
    post_process: bool = True,
    share_embeddings: bool = False,
    pg_collection: Any = None,
):
    """A megatron-core HybridModel with the CPU stack spec (``mopd.mcore.cpu``) and learned
    absolute positions: ``pattern`` of ``*`` (attention) and ``-`` (MLP) layers, ``|`` between
    pipeline stages (each rank builds its own stage's segment)."""
    apply()  # first: megatron-core imported with its fusions plain (mopd.mcore.cpu)
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from mopd.mcore.cpu import cpu_hybrid_stack_spec

    extra: dict[str, Any] = {}
    if pg_collection is not None:
        extra["pg_collection"] = pg_collection
    return HybridModel(
        config=config,
        hybrid_stack_spec=cpu_hybrid_stack_spec(),
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        hybrid_layer_pattern=pattern,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share_embeddings,
        position_embedding_type="learned_absolute",
        **extra,
    )


def gather_vocab_shards(logits_local: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """All-gather ``[..., V/tp]`` vocab shards over ``tp_group`` into ``[..., V]``."""
    import torch.distributed as dist

    world = dist.get_world_size(tp_group)
    if world == 1:
        return logits_local
    parts = [torch.empty_like(logits_local) for _ in range(world)]
    dist.all_gather(parts, logits_local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def full_state(model: torch.nn.Module, tp_group: Any) -> dict[str, torch.Tensor]:
    """Every parameter of a TP-sharded model, gathered to its full (TP=1) shape.

    Megatron tags parallel parameters with ``tensor_model_parallel`` and ``partition_dim``;
    shards concatenate along that dim in TP-rank order (true for the local layer spec, whose
    QKV is laid out by query group).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False):
            out[name] = gather_vocab_shards(t.movedim(p.partition_dim, -1), tp_group).movedim(
                -1, p.partition_dim
            )
        else:
            out[name] = t.clone()
    return out


def load_full_state(
    model: torch.nn.Module, full: dict[str, torch.Tensor], tp_rank: int, tp_size: int
) -> None:
    """Load full (TP=1) tensors into a TP-sharded model: the inverse of :func:`full_state`."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = full[name]
            if getattr(p, "tensor_model_parallel", False) and tp_size > 1:
                t = t.chunk(tp_size, dim=p.partition_dim)[tp_rank]
            p.copy_(t)
