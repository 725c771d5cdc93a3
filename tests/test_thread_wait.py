"""How an artifact's CPU threads wait for work: chosen from the model timed both ways, set in fresh processes."""

from __future__ import annotations

import os

from edgetune.isolated import processes_with
from edgetune.runtime import SPIN_COUNT_ENV, spin_count, thread_wait_policy


def test_threads_sleep_unless_it_slows_the_idle_model_by_more_than_5_percent() -> None:
    assert thread_wait_policy(spinning_ms=10.0, sleeping_ms=9.0) == "sleep"
    assert thread_wait_policy(spinning_ms=10.0, sleeping_ms=10.5) == "sleep"
    assert thread_wait_policy(spinning_ms=10.0, sleeping_ms=10.6) == "spin"
    assert thread_wait_policy(spinning_ms=3.4, sleeping_ms=4.4) == "spin"  # a MobileNet-V2's many short kernels
    assert spin_count("sleep") == 0
    assert spin_count("spin") is None and spin_count(None) is None  # TVM's default: it spins


def _environment_value(name: str) -> str | None:
    return os.environ.get(name)


def test_each_fresh_process_starts_with_its_own_environment(monkeypatch) -> None:
    """TVM reads the spin count once, when a process's pool starts: each policy needs a process set up before."""
    monkeypatch.setenv(SPIN_COUNT_ENV, "123")  # the parent's value is removed where None asks it
    with processes_with([{SPIN_COUNT_ENV: None}, {SPIN_COUNT_ENV: "0"}]) as (spinning, sleeping):
        assert spinning.submit(_environment_value, SPIN_COUNT_ENV).result() is None
        assert sleeping.submit(_environment_value, SPIN_COUNT_ENV).result() == "0"
    assert os.environ[SPIN_COUNT_ENV] == "123"
