"""Stage: measure. The packaged library, the same model untuned, and the reference, timed where the
device is: on this machine, or on the device over RPC (where the reference cannot run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from edgetune.build.context import TargetBuild
from edgetune.machine_load import TAKEN_CORE, OtherLoad, low_priority_busy_process
from edgetune.runtime import (
    TIMING_ROUNDS,
    ThreadWait,
    each_in_turns,
    thread_wait_policy,
    thread_wait_ways,
)

SPREAD_NOTED = 1.1
"""Rounds further apart than this (slowest / fastest) are reported."""


@dataclass(frozen=True)
class ThreadWaitChoice:
    """How the artifact's CPU threads wait for work, who chose it ("measured": the build, from the tuned model's
    latencies; "recipe": `package.thread_wait`), and those latencies (ms; idle: medians of the rounds; busy: beside
    a low-priority busy process; None: not timed so here)."""

    policy: ThreadWait
    chosen_by: Literal["measured", "recipe"]
    spinning_ms: float | None
    sleeping_ms: float | None
    spinning_busy_ms: float | None = None
    sleeping_busy_ms: float | None = None
    pooled_ms: float | None = None  # edgetune's pool (thread_pool.py), where it was built for the target
    pooled_busy_ms: float | None = None
    timed_beside_other_programs: bool = False  # its idle rounds were not an idle machine's (other programs ran)


@dataclass(frozen=True)
class Latency:
    """Milliseconds (None: not measured) and where they were measured (None: nowhere)."""

    tuned: float | None = None
    untuned: float | None = None
    reference: float | None = None
    measured_on: str | None = None
    thread_wait: ThreadWaitChoice | None = None  # None: TVM's default (spinning), neither measured nor asked for

    def as_manifest(self) -> dict[str, float | None]:
        """The manifest's `latency_ms`; the reference keeps the key it has always had."""
        return {"tuned": self.tuned, "untuned": self.untuned, "onnxruntime": self.reference}


def measure_stage(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray], pool: Path | None) -> Latency:
    """Time the tuned and the untuned model (`ctx.untuned`, compiled beside the tuned one) on the target's
    device; the reference only beside them here. `pool`: edgetune's thread pool built for the target, timed as
    a third way of waiting (None: not built)."""
    device, wanted = ctx.device, ctx.recipe.package.thread_wait
    if not device.can_measure:
        return Latency(thread_wait=choose_thread_wait(wanted, None, ctx.say))
    if device.runs_here:
        ctx.say(f"timing tuned, untuned and {ctx.reference.display_name}")
    else:
        ctx.say(f"timing tuned and untuned on the device ({device.where})")
    inputs = ctx.sample_list(samples)
    timed_ways: dict[str, list[float]] | None = None
    reference_ms, busy, others_cores = None, None, 0.0
    # the timers' processes start while the untuned model's compile ends, if it has not
    with device.thread_wait_timers(library, inputs, thread_wait_ways(wanted, pool is not None), pool) as timers:
        ctx.untuned.library()  # its compile ends before anything is timed: a compile beside a timing disturbs it
        if device.runs_here:
            threads = ctx.profile.hardware.cores or 1
            ours = timers or {"tuned": lambda: device.latency_ms(library, inputs)}
            load = OtherLoad()  # the timers run in this process's children: only other programs count
            rounds = each_in_turns({**ours, "reference": lambda: ctx.reference.time(samples, threads=threads)},
                                   TIMING_ROUNDS)
            others_cores = load.cores_taken()
            reference_ms = rounds.pop("reference")
            timed_ways = rounds if timers else None
            busy = timed_beside_busy_process(timers) if timers and len(timers) > 1 else None
        else:
            rounds = {"tuned": [device.latency_ms(library, inputs)]}
    thread_wait = choose_thread_wait(wanted, timed_ways, ctx.say, busy, others_cores)
    tuned_ms = rounds[thread_wait.policy] if timed_ways and thread_wait else rounds["tuned"]
    if reference_ms:
        _say_spread(ctx, "tuned model", tuned_ms)
        _say_spread(ctx, ctx.reference.display_name, reference_ms)
    untuned_ms = ctx.untuned_latency_ms(inputs)
    return Latency(tuned=float(np.median(tuned_ms)), untuned=untuned_ms,
                   reference=float(np.median(reference_ms)) if reference_ms else None, measured_on=device.where,
                   thread_wait=thread_wait)


def timed_beside_busy_process(timers: dict[str, Callable[[], float]]) -> dict[str, float]:
    """The tuned model timed once each way (ms) beside a low-priority busy process: what each way costs where
    the artifact shares the machine."""
    with low_priority_busy_process():
        return {way: timer() for way, timer in timers.items()}


def choose_thread_wait(wanted: ThreadWait | Literal["auto"], timed: dict[str, list[float]] | None,
                       say: Callable[[str], None], busy: dict[str, float] | None = None,
                       others_cores: float = 0.0) -> ThreadWaitChoice | None:
    """How the artifact's threads wait for work: the recipe's way, or ("auto") where the tuned model was timed
    each way here, runtime.thread_wait_policy's: the way that loses least against the fastest, idle or beside a
    busy process (spinning threads hand such a process the cores: runtime.SPIN_COUNT_ENV); None keeps TVM's
    default. `timed`: the model's idle rounds (ms) per way it
    was timed in (None: not timed so, as over RPC); `busy`: its ms per way beside a low-priority busy process;
    `others_cores`: the cores other programs used while `timed` was timed (then its rounds are not an idle
    machine's, and the build says what the other way may give on one)."""
    medians = {way: float(np.median(rounds)) for way, rounds in (timed or {}).items()}
    busy = busy or {}
    spinning, sleeping = medians.get("spin"), medians.get("sleep")
    if wanted != "auto":
        say(f"the artifact's threads {wanted} while they wait for work, as the recipe says (package.thread_wait)")
        return ThreadWaitChoice(wanted, "recipe", spinning, sleeping)
    if sleeping is None or len(medians) < 2:  # both ways timed, or nothing to choose from
        return None
    # a daemon's tick is not a busy machine: other programs count from the share of a core the tuner counts
    choice = ThreadWaitChoice(thread_wait_policy(medians, busy), "measured", spinning, sleeping, busy.get("spin"),
                              busy.get("sleep"), medians.get("pool"), busy.get("pool"),
                              timed_beside_other_programs=others_cores >= TAKEN_CORE)
    cost = ", ".join(f"{ms:.3f} ms {_WAYS[way]}" for way, ms in medians.items())
    if set(busy) == set(medians):
        cost += "; beside a low-priority busy process " + ", ".join(f"{ms:.3f} ms {_WAYS[way]}"
                                                                     for way, ms in busy.items())
    verb, reason = _CHOSEN[choice.policy]
    say(f"the artifact's threads {verb} while they wait for work ({cost}): {reason}"
        + _timed_beside_other_programs(choice, others_cores))
    return choice


_WAYS = {"spin": "spinning", "sleep": "sleeping", "pool": "in edgetune's pool"}
_CHOSEN = {"spin": ("spin (TVM's pool)", "the other ways cost it more"),
           "sleep": ("sleep (TVM's pool)", "other busy processes keep their share of the cores"),
           "pool": ("spin 50 us on the cores they hold, then sleep, in edgetune's pool (threads.so)",
                    "it lost least, idle and beside a busy process")}


def _timed_beside_other_programs(choice: ThreadWaitChoice, others_cores: float) -> str:
    """What the choice leaves open where other programs held cores while the model was timed "idle": a
    transformer encoder built beside a busy loop shipped sleeping threads (96 ms spinning, 1.1 ms sleeping there)
    and ran 0.46 ms on the idle machine, where it spun in 0.23 ms. Empty on a machine left to the build."""
    if not choice.timed_beside_other_programs:
        return ""
    other = ("spinning threads may be faster (package.thread_wait: spin)" if choice.policy == "sleep"
             else "sleeping threads may cost less (package.thread_wait: sleep)")
    return (f"; other programs used {others_cores:.1f} cores while the model was timed, so neither figure is an "
            f"idle machine's: on an idle machine {other}")


def _say_spread(ctx: TargetBuild, what: str, rounds_ms: list[float]) -> None:
    """The rounds that disagree, so that a reader knows the machine was disturbed while timing."""
    if len(rounds_ms) > 1 and max(rounds_ms) > SPREAD_NOTED * min(rounds_ms):
        ctx.say(f"timing rounds of the {what} ranged {min(rounds_ms):.3f}-{max(rounds_ms):.3f} ms (other work "
                f"on the machine): the median, {float(np.median(rounds_ms)):.3f} ms, is reported")

