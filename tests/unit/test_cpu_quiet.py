"""Tier 1: ``mopd.mcore.cpu.quiet()`` silences exactly megatron-core's known CPU notices, and
nothing of this library's own.

What a user relies on: the examples call it once and print only their own lines, while every
warning the library gives (a padded vocabulary, an empty step, ...) still reaches them; and the
two torch deprecations it silences are never this library's, since the library calls neither
old collective.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from mopd.mcore import cpu

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("common", "capture", "kernels", "bridge", "mcore", "profiling")

#: (category, message, the module the warning is attributed to) as megatron-core and torch emit
#: them on a CPU machine without Transformer Engine and Apex.
MEGATRON_NOTICES = [
    (
        UserWarning,
        "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
        "megatron.core.optimizer",
    ),
    (
        UserWarning,
        "Apex is not installed. Falling back to Torch Norm",
        "megatron.core.models.backends",
    ),
    (
        UserWarning,
        "When using sequence parallelism it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
        "megatron.core.tensor_parallel.layers",
    ),
    (
        UserWarning,
        "When using async grad allreduce it is recommended to set the environment variable "
        "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup",
        "megatron.core.tensor_parallel.layers",
    ),
    (
        UserWarning,
        "full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
        "megatron.core.transformer.transformer_config",
    ),
    (
        FutureWarning,
        "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
        "`torch.distributed.all_gather_single` instead.",
        "torch.distributed.c10d_logger",
    ),
    (
        FutureWarning,
        "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
        "`torch.distributed.reduce_scatter_single` instead.",
        "torch.distributed.c10d_logger",
    ),
]


def _shown(category: type[Warning], message: str, module: str) -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(
            message, category, f"{module.replace('.', '/')}.py", 1, module=module
        )
    return bool(seen)


@pytest.mark.parametrize(("category", "message", "module"), MEGATRON_NOTICES)
def test_quiet_silences_each_known_notice(category, message, module) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert _shown(category, message, module)  # shown before
        cpu.quiet()
        assert not _shown(category, message, module)
        cpu.quiet()  # idempotent
        assert not _shown(category, message, module)


def test_quiet_keeps_every_other_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        cpu.quiet()
        # the same text from another package is not megatron-core's notice
        assert _shown(UserWarning, "Apex is not installed. Falling back to Torch Norm", "mopd.x")
        assert _shown(UserWarning, "Transformer Engine is not installed", "megatron.core.x")
        assert _shown(FutureWarning, "`torch.distributed.all_gather` is deprecated", "torch.x")
        from mopd.common.log import reset_once, warn_once

        reset_once()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            cpu.quiet()
            warn_once("MOPD step 3: no row of the student's micro-batches counts on any rank")
        assert [str(w.message) for w in seen] == [
            "MOPD step 3: no row of the student's micro-batches counts on any rank"
        ]
        reset_once()


def test_quiet_names_exactly_what_it_silences() -> None:
    assert len(cpu.QUIETED) == len(MEGATRON_NOTICES) - 1  # one filter: both CUDA_DEVICE_... notes
    doc = " ".join((cpu.quiet.__doc__ or "").split())
    for words in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed. Falling back to Torch Norm",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "full scope is deprecated",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    ):
        assert words in doc, words


def test_the_library_calls_no_deprecated_collective() -> None:
    """Calls of ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in the package's source
    (a reference for the fallback of an older torch is not a call)."""
    calls = []
    for folder in LIBRARY:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("all_gather_into_tensor", "reduce_scatter_tensor")
                ):
                    calls.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not calls, calls
