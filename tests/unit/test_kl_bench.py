"""Tier 1: the KL benchmark's harness runs on CPU (``--quick``) and records what it measured.

Not a timed test: it checks that every peer runs, that their losses agree with ours (the same
reverse KL, so ``loss_rel_diff`` is small), that the CPU output is labelled functional, prints
each table once and leaves out the columns that mean nothing there (floor, memory), that the
numerics part records its CSV and log-scale PNG with our errors far below plain bf16's, and
that ``--baseline`` pairs an earlier run's errors with this one's.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest
import torch

from mopd.profiling.bench import kl as bench_kl


def _rows(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


def test_quick_run_records_rows_that_agree(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert bench_kl.main(["--quick", "--tokens", "40", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "skipping Liger-Kernel" in out or "Liger-Kernel JSD" in out
    assert "functional check on the CPU: not performance figures" in out
    # each table once: one header line per part
    assert (
        out.count("| method | T | H | V | fwd_bwd |") == 1
    )  # a column of times: units in its cells
    # the numerics: a line per case as it goes, the worst errors per method, path and kind, and
    # a summary line; every row in the CSV
    assert re.findall(r"^  (\d) of 2: V=1000 logit std [\d.]+: measured \(\d+ s\)$", out, re.M) == [
        "1",
        "2",
    ]
    assert (
        out.count("| method | path | kind | cases | worst_loss_rel_err | worst_grad_rel_err |") == 1
    )
    assert "| method | path | kind | V | logit_std |" not in out
    summary = re.search(
        r"^summary over 24 rows, relative error against float64: ours up to (\S+) \(loss\)",
        out,
        re.M,
    )
    assert summary and float(summary[1]) < 1e-5, out[-2000:]
    speed = tmp_path.glob("kl-cpu-*.csv")
    (speed_csv,) = list(speed)
    rows = _rows(speed_csv)
    assert {"x_floor", "extra_GiB", "floor_ms"}.isdisjoint(rows[0])  # meaningless on a CPU
    assert "FUNCTIONAL CPU RUN" in speed_csv.with_suffix(".md").read_text()
    methods = {r["method"] for r in rows}
    assert {"naive torch", "torch chunked 1024"} <= methods
    assert any(m.startswith("ours") for m in methods)
    for r in rows:
        assert float(r["fwd_bwd_ms"]) > 0
        assert float(r["loss_rel_diff"]) < 1e-4, r

    (num_csv,) = list(tmp_path.glob("kl-numerics-cpu-*.csv"))
    assert num_csv.with_name(num_csv.stem + "-errors.png").stat().st_size > 0
    num = _rows(num_csv)
    assert {r["kind"] for r in num} == {"reverse", "forward", "mixed"}
    assert {r["path"] for r in num} == {"logits", "fused"}
    for r in num:
        if r["method"] == "ours":
            assert float(r["loss_rel_err"]) < 1e-5 and float(r["grad_rel_err"]) < 5e-3, r
        elif float(r["logit_std"]) >= 12:  # plain bf16 logits: far worse at a large logit std
            assert float(r["loss_rel_err"]) > 1e-3 and float(r["grad_rel_err"]) > 5e-2, r


def test_baseline_pairs_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["--quick", "--part", "numerics", "--logit-stds", "4", "--num-vocabs", "300"]
    assert bench_kl.main([*args, "--results-dir", str(tmp_path)]) == 0
    (first,) = list(tmp_path.glob("kl-numerics-cpu-*.csv"))
    baseline = tmp_path / "baseline.csv"
    first.rename(baseline)
    assert bench_kl.main([*args, "--results-dir", str(tmp_path), "--baseline", str(baseline)]) == 0
    (paired,) = list(tmp_path.glob("kl-numerics-vs-baseline-*.csv"))
    rows = _rows(paired)
    assert len(rows) == 12  # 2 methods x 2 paths x 3 kinds
    for r in rows:  # the same code and inputs twice: the same errors
        assert r["loss_rel_err_before"] == r["loss_rel_err_after"]
        assert r["grad_rel_err_before"] == r["grad_rel_err_after"]
    assert "numerics beside baseline.csv" in capsys.readouterr().out


def test_peers_compute_the_same_gradients() -> None:
    x = bench_kl.make_inputs(50, 8, 70, torch.float64, torch.device("cpu"))
    grads = []
    for fn in (bench_kl.naive_torch, lambda x: bench_kl.chunked_torch(x, chunk=16)):
        for t in x[:2]:
            t.grad = None
        fn(x)
        grads.append([t.grad.clone() for t in x[:2]])
    for t in x[:2]:
        t.grad = None
    bench_kl.ours(x, bench_kl.KLConfig(chunk_tokens=7))
    grads.append([t.grad.clone() for t in x[:2]])
    for g in grads[1:]:
        for a, b in zip(g, grads[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_cpu_run_names_what_it_skips_in_one_line() -> None:
    numerics = bench_kl._parse(["--part", "numerics"])
    line = bench_kl.cpu_skips(numerics, cuda=False)
    assert line == (
        "mopd bench kl on a CPU: skipped the speed part (it needs CUDA; --quick checks its "
        "harness on the CPU) and Liger-Kernel in the numerics (a GPU peer)"
    )
    quick = bench_kl._parse(["--quick"])  # both parts run: only the GPU peer is left out
    assert bench_kl.cpu_skips(quick, cuda=False) == (
        "mopd bench kl on a CPU: skipped Liger-Kernel in the numerics (a GPU peer)"
    )
    assert bench_kl.cpu_skips(numerics, cuda=True) is None


def test_speed_part_refuses_a_cpu_only_machine() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the measured run is allowed")
    with pytest.raises(SystemExit):
        bench_kl.main(["--part", "speed"])
