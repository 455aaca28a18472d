"""Tier 1: the demo's verdict line, results file and loss-curve picture
(:mod:`mopd.profiling.demo.report`).

What a reader relies on: the last line says whether the rows were exact and whether the
student's held-out KL fell for every teacher, with the ratios it judged by; the results file
holds the run's figures and the machine; the picture is drawn from them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mopd.profiling.demo.report import verdict, write

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("heldout", "line"),
    [
        (
            [[0.7763, 0.6, 0.4696], [1.0813, 0.9, 0.7379]],
            "mopd demo: OK - rows exact, student learned: held-out KL 0.60x / 0.68x",
        ),
        (
            [[0.7, 0.5], [1.0, 1.02]],
            "mopd demo: OK - rows exact, student did not learn: held-out KL 0.71x / 1.02x",
        ),
        ([[0.7], [1.0]], "mopd demo: OK - rows exact; one step, so no held-out trend to judge"),
        ([[0.9, 0.45]], "mopd demo: OK - rows exact, student learned: held-out KL 0.50x"),
    ],
)
def test_verdict(heldout: list[list[float]], line: str) -> None:
    assert verdict(rows_ok=True, bad_ranks=0, heldout=heldout) == line


def test_verdict_of_a_mismatch_names_the_ranks() -> None:
    assert verdict(rows_ok=False, bad_ranks=2, heldout=[]) == (
        "mopd demo: FAILED - bridged rows differ from the all-gather reference on 2 ranks"
    )


def test_write_records_the_results_and_draws_the_curves(tmp_path: Path) -> None:
    result = {
        "rollout_kl": [[0.9, 0.8, 0.7], [1.1, 1.0, 0.9]],
        "heldout_kl": [[0.8, 0.7, 0.6], [1.0, 0.95, 0.9]],
    }
    env = {"date": "2026-12-03 10:00 UTC", "gpu": "none (CPU)", "torch": "2.13.0"}
    json_path, png = write(result, out_dir=tmp_path / "r", env=env, draw=True)
    assert json_path == tmp_path / "r" / "demo-cpu-2026-12-03.json"
    data = json.loads(json_path.read_text())
    assert data["heldout_kl"] == result["heldout_kl"] and data["environment"]["torch"] == "2.13.0"
    assert png == json_path.with_suffix(".png") and png.read_bytes().startswith(PNG_MAGIC)
    import matplotlib.image

    assert matplotlib.image.imread(png).std() > 0.05  # lines, not a blank canvas
    json_path.unlink()
    png.unlink()
    _, png = write(result, out_dir=tmp_path / "r", env=env, draw=False)
    assert png is None and [p.suffix for p in (tmp_path / "r").iterdir()] == [".json"]
