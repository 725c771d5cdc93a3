"""The benchmarks label each timing round with where the VM's two CPUs were (benchmarks/placement.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from placement import NEAR_NS, CoreDistance, placement


def test_a_round_is_labelled_by_the_round_trips_around_it() -> None:
    assert placement(50.0, 60.0) == "together"
    assert placement(330.0, 340.0) == "apart"
    assert placement(50.0, 330.0) == "moved"
    assert placement(None, 50.0) == "unknown"
    assert placement(NEAR_NS, NEAR_NS) == "apart"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no round trip to time")
def test_the_probe_times_a_round_trip_and_leaves_the_callers_cpus_as_they_were() -> None:
    cpus = os.sched_getaffinity(0)
    round_trip = CoreDistance().round_trip_ns()
    assert round_trip is not None and 1.0 < round_trip < 100_000.0
    assert os.sched_getaffinity(0) == cpus
