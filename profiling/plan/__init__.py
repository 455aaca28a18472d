"""mopd.profiling.plan: ``mopd plan``, the bridge's transfers for two meshes and a batch, job-wide.

``request`` (what is asked, every rank's layouts), ``simulate`` (the step as every rank plans
it), ``figures`` (:func:`inspect_plan`: bytes, balance, times), ``report`` (text and JSON),
``heatmap`` (a PNG), ``inspector`` (the command line; ``python -m mopd.profiling.plan``).
"""

from __future__ import annotations

from mopd.profiling.plan.figures import PlanReport, inspect_plan
from mopd.profiling.plan.heatmap import render_heatmap
from mopd.profiling.plan.inspector import build_parser, main
from mopd.profiling.plan.report import format_report, report_to_dict
from mopd.profiling.plan.request import PlanRequest, build_layouts
from mopd.profiling.plan.simulate import SimulatedStep, simulate_step

__all__ = [
    "PlanReport",
    "PlanRequest",
    "SimulatedStep",
    "build_layouts",
    "build_parser",
    "format_report",
    "inspect_plan",
    "main",
    "render_heatmap",
    "report_to_dict",
    "simulate_step",
]
