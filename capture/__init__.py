"""mopd.capture: the teacher's pre-LM-head hidden states, captured on the GPU.

The public API is NeMo-RL's ``nemo_rl.models.megatron.opd_full_capture`` (same names; by default
the same answers), plus what real Megatron setups need: unwrapping, the SP gather, and a
zero-allocation path into a buffer the caller owns.
"""

from __future__ import annotations

from mopd.capture.capture import (
    CaptureMisuseError,
    OutputLayerInputCapture,
    get_opd_full_capture_context,
)
from mopd.capture.gather import ReusableBuffer, gather_sequence_parallel
from mopd.capture.unwrap import find_output_layer

__all__ = [
    "CaptureMisuseError",
    "OutputLayerInputCapture",
    "ReusableBuffer",
    "find_output_layer",
    "gather_sequence_parallel",
    "get_opd_full_capture_context",
]
