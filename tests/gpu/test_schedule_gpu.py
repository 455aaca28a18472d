"""Tier 3 (GPU): a schedule's index tensors reach the device in one asynchronous copy, and are
safe to read from a stream other than the one that uploaded them.

Also: every index a real rank schedule's data path reads (a ``plan_rank`` plan of a simulated
step, built with ``RankSchedule.build``) comes from that one upload, equal to the host values;
``copy_runs`` with and without its row count gives the same bytes. No process group is needed.
"""

from __future__ import annotations

import pytest
import torch

from mopd.bridge import Mesh
from mopd.bridge.plan import plan_rank
from mopd.bridge.schedule import DeviceIndices, RankSchedule
from mopd.kernels.rows import copy_runs
from mopd.profiling.synthetic import SideFormat, synthetic_step
from tests.support.plan_sim import simulate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="tier 3 needs a CUDA device; none here"
    ),
]

DEVICE = torch.device("cuda", 0)
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: long enough that a missing wait shows


def test_one_upload_holds_every_tensor_and_equals_the_host_values() -> None:
    gen = torch.Generator().manual_seed(0)
    host = [torch.randint(0, 1000, (n,), generator=gen) for n in (7, 0, 33, 1)]
    host.append(torch.arange(12, dtype=torch.int64).view(3, 4))
    dev = DeviceIndices(host, DEVICE)
    assert dev.uploads == 1
    for t in host:
        got = dev(t)
        assert got.device == DEVICE and got.shape == t.shape
        assert torch.equal(got.cpu(), t)
    assert dev.late_uploads == 0


def test_upload_does_not_block_the_host() -> None:
    """The copy is queued behind a long kernel; constructing returns before it has run."""
    torch.cuda.synchronize()
    t = torch.arange(1 << 16, dtype=torch.int64)
    torch.cuda._sleep(SLEEP_CYCLES)
    dev = DeviceIndices([t], DEVICE)
    still_busy = not torch.cuda.current_stream(DEVICE).query()
    torch.cuda.synchronize()
    assert still_busy, "the upload waited for the device (a synchronous copy)"
    assert torch.equal(dev(t).cpu(), t)


def test_other_stream_waits_for_the_upload() -> None:
    """Upload on stream A behind a long kernel, read on stream B: B must see the values.

    The caching allocator hands the upload a block freed on A that was filled with a poison
    value, so a read that does not wait for the copy returns the poison.
    """
    n = 1 << 16
    t = torch.arange(n, dtype=torch.int64)
    a, b = torch.cuda.Stream(DEVICE), torch.cuda.Stream(DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        poison = torch.full((n,), 10**12, dtype=torch.int64, device=DEVICE)
        ptr = poison.data_ptr()
        del poison
        torch.cuda._sleep(SLEEP_CYCLES)
        dev = DeviceIndices([t], DEVICE)
    with torch.cuda.stream(b):
        idx = dev(t)
        seen = idx * 1  # runs on B
    reused = idx.data_ptr() == ptr
    torch.cuda.synchronize()
    assert torch.equal(seen.cpu(), t), "stream B read the indices before the upload landed"
    if not reused:
        pytest.fail("the allocator did not reuse the poisoned block: the test proved nothing")


def test_memory_read_on_another_stream_is_not_reused_before_that_read() -> None:
    """Free the indices while stream B still has to read them: the block must not be handed
    out again on stream A (``record_stream``) before B's read has run."""
    n = 1 << 16
    t = torch.arange(n, dtype=torch.int64)
    a, b = torch.cuda.Stream(DEVICE), torch.cuda.Stream(DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        dev = DeviceIndices([t], DEVICE)
    with torch.cuda.stream(b):
        idx = dev(t)
        ptr = idx.data_ptr()
        torch.cuda._sleep(SLEEP_CYCLES)  # B reads only after this
        seen = idx * 1
    del dev, idx
    with torch.cuda.stream(a):
        other = torch.full((n,), -7, dtype=torch.int64, device=DEVICE)  # may reuse a block
    same_block = other.data_ptr() == ptr
    torch.cuda.synchronize()
    assert not same_block, "the freed indices were handed out while stream B still read them"
    assert torch.equal(seen.cpu(), t)


def test_copy_runs_with_and_without_the_row_count_agree() -> None:
    """``num_rows`` sizes the grid only: the bytes are the same as without it."""
    gen = torch.Generator().manual_seed(1)
    src = torch.randn(4096, 72, generator=gen).to(DEVICE, torch.bfloat16)
    start = torch.tensor([0, 100, 3000], device=DEVICE)
    dst = torch.tensor([10, 200, 900], device=DEVICE)
    length = torch.tensor([50, 600, 96], device=DEVICE)
    outs = []
    for num_rows in (None, 746):
        out = torch.full((2048, 72), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        copy_runs(src, start, dst, length, out, num_rows=num_rows)
        outs.append(out.view(torch.int16))
    assert torch.equal(outs[0], outs[1])
    want = torch.full((2048, 72), float("nan"), dtype=torch.bfloat16).view(torch.int16)
    s = src.cpu().view(torch.int16)
    for a, d, n in ((0, 10, 50), (100, 200, 600), (3000, 900, 96)):
        want[d : d + n] = s[a : a + n]
    assert torch.equal(outs[0].cpu(), want)


def test_a_real_schedule_uploads_every_index_its_data_path_reads_once() -> None:
    teachers, student = [Mesh(tp=2, dp=2)], Mesh(tp=2, dp=2)
    step = synthetic_step(
        teachers=teachers,
        student=student,
        num_samples=8,
        max_len=64,
        teacher_formats=[SideFormat(kind="thd", micro_batch=2)],
        student_format=SideFormat(kind="sbh", micro_batch=3, pad_multiple=1),
        seed=2,
    )
    sim = simulate(teachers, student, step.teacher_layouts, step.student_layouts)
    read = 0
    for r in sim.topology.members:
        plan = plan_rank(sim.catalog, r, local_copy=r % 2 == 0)
        nominal = sim.catalog.dests[plan.dest.group].slice_rows if plan.dest is not None else 0
        s = RankSchedule.build(plan, slice_rows=nominal, num_owners=1, row_bytes=[2])
        host = s.data_path_indices(integrity=True)
        dev = DeviceIndices(host, DEVICE)
        assert dev.uploads == (1 if host else 0)
        for t in host:
            got = dev(t)
            assert got.device == DEVICE and torch.equal(got.cpu(), t)
            read += 1
        assert dev.late_uploads == 0
    assert read, "no schedule reads an index: the case proves nothing"
