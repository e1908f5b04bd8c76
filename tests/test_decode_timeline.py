"""scripts/decode_timeline.py's reading of a CUDA trace: the copy engine's busy time and idle gaps per decoding step
(the trace itself is made on the GPU machine; this checks the arithmetic on a trace written by hand)."""

from __future__ import annotations

import pytest

from testing_scripts import load_script


@pytest.fixture(scope="module")
def timeline():
    return load_script("decode_timeline")


def event(name, ts, dur, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def step_events(t0, copies, kernels):
    """One step starting at t0 (microseconds): PyTorch's marker, then copies and kernels at offsets."""
    yield event("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", t0, 1)
    for start, dur in copies:
        yield event("Memcpy HtoD (Pinned -> Device)", t0 + start, dur, "gpu_memcpy", bytes=1_000_000)
    for name, start, dur in kernels:
        yield event(name, t0 + start, dur)


def test_busy_time_gaps_and_what_ran_in_the_largest_gap(timeline):
    events = []
    for t0 in (0, 1000):
        # copies over [10, 400) and [450, 900); a kernel in the 50 us gap; the last 100 us idle
        events += step_events(t0, [(10, 200), (150, 250), (450, 450)], [("flash_attn_ext_f16", 400, 40)])
    events.append(event("FillFunctor<float>", 2000, 1))
    lines = timeline.summarize(events, gap_us=20)
    rows = [line for line in lines if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1] == "1.000"          # step: marker to marker
    assert cells[2] == "0.840"          # busy: 390 + 450 us, overlapping copies counted once
    assert cells[3] == "3.0"            # MB
    assert cells[4] == "2, 0.150"       # 50 us between copies, 100 us at the end (the 10 us at the start is below 20)
    assert cells[5].startswith("0.100 (at 0.90: no kernel)")
    assert "copies busy 0.840 ms (84.0%)" in lines[-1]


def test_a_copy_running_across_the_step_boundary_counts_in_both_steps(timeline):
    # the prefetch of step 1 starts before step 1's marker (the device finished step 0) and ends after it
    events = list(step_events(0, [(0, 900)], []))
    events.append(event("Memcpy HtoD (Pinned -> Device)", 950, 200, "gpu_memcpy", bytes=1_000_000))
    events += step_events(1000, [(150, 850)], [("mul_mat", 160, 10)])
    events.append(event("FillFunctor<float>", 2000, 1))
    lines = timeline.summarize(events, gap_us=20)
    step1 = [c.strip() for c in lines[3].strip("|").split("|")]
    assert step1[2] == "1.000"          # [1000, 1150) from the prefetch and [1150, 2000)
    assert step1[4].startswith("0,")


def test_without_markers_it_says_so(timeline):
    assert "nothing to report" in timeline.summarize([event("mul_mat", 0, 5)], gap_us=20)[0]
