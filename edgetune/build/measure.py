"""Stage: measure. The packaged library, the same model untuned, and the reference, timed where the
device is: on this machine, or on the device over RPC (where the reference cannot run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from edgetune.build.context import TargetBuild
from edgetune.runtime import (
    SLEEPING_COST_ACCEPTED,
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
    idle latencies; "recipe": `package.thread_wait`), and those latencies (ms, medians of the rounds; None: that
    way was not timed here)."""

    policy: ThreadWait
    chosen_by: Literal["measured", "recipe"]
    spinning_ms: float | None
    sleeping_ms: float | None


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


def measure_stage(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray]) -> Latency:
    """Time the tuned and the untuned model (`ctx.untuned`, compiled beside the tuned one) on the target's
    device; the reference only beside them here."""
    device, wanted = ctx.device, ctx.recipe.package.thread_wait
    if not device.can_measure:
        return Latency(thread_wait=choose_thread_wait(wanted, None, ctx.say))
    if device.runs_here:
        ctx.say(f"timing tuned, untuned and {ctx.reference.display_name}")
    else:
        ctx.say(f"timing tuned and untuned on the device ({device.where})")
    inputs = ctx.sample_list(samples)
    timed_ways: dict[str, list[float]] | None = None
    reference_ms = None
    # the timers' processes start while the untuned model's compile ends, if it has not
    with device.thread_wait_timers(library, inputs, thread_wait_ways(wanted)) as timers:
        untuned = ctx.untuned.library()
        if device.runs_here:
            threads = ctx.profile.hardware.cores or 1
            ours = timers or {"tuned": lambda: device.latency_ms(library, inputs)}
            rounds = each_in_turns({**ours, "reference": lambda: ctx.reference.time(samples, threads=threads)},
                                   TIMING_ROUNDS)
            reference_ms = rounds.pop("reference")
            timed_ways = rounds if timers else None
        else:
            rounds = {"tuned": [device.latency_ms(library, inputs)]}
    thread_wait = choose_thread_wait(wanted, timed_ways, ctx.say)
    tuned_ms = rounds[thread_wait.policy] if timed_ways and thread_wait else rounds["tuned"]
    if reference_ms:
        _say_spread(ctx, "tuned model", tuned_ms)
        _say_spread(ctx, ctx.reference.display_name, reference_ms)
    return Latency(tuned=float(np.median(tuned_ms)), untuned=device.latency_ms(untuned, inputs),
                   reference=float(np.median(reference_ms)) if reference_ms else None, measured_on=device.where,
                   thread_wait=thread_wait)


def choose_thread_wait(wanted: ThreadWait | Literal["auto"], timed: dict[str, list[float]] | None,
                       say: Callable[[str], None]) -> ThreadWaitChoice | None:
    """How the artifact's threads wait for work: the recipe's way, or ("auto") sleeping where the tuned model was
    timed both ways here and sleeping cost it at most SLEEPING_COST_ACCEPTED (robust beside other busy processes,
    where spinning threads hand them the cores: runtime.SPIN_COUNT_ENV); None keeps TVM's default. `timed`: the
    model's rounds (ms) per way it was timed in (None: not timed so, as over RPC)."""
    medians = {way: float(np.median(rounds)) for way, rounds in (timed or {}).items()}
    spinning, sleeping = medians.get("spin"), medians.get("sleep")
    if wanted != "auto":
        say(f"the artifact's threads {wanted} while they wait for work, as the recipe says (package.thread_wait)")
        return ThreadWaitChoice(wanted, "recipe", spinning, sleeping)
    if spinning is None or sleeping is None:
        return None
    choice = ThreadWaitChoice(thread_wait_policy(spinning, sleeping), "measured", spinning, sleeping)
    cost = f"{sleeping:.3f} ms with them sleeping against {spinning:.3f} ms spinning"
    if choice.policy == "sleep":
        say(f"the artifact's threads sleep while they wait for work ({cost}): other busy processes "
            "keep their share of the cores")
    else:
        say(f"the artifact's threads spin while they wait for work ({cost}, more than "
            f"{SLEEPING_COST_ACCEPTED:.2f}x): beside other busy processes it slows down more")
    return choice


def _say_spread(ctx: TargetBuild, what: str, rounds_ms: list[float]) -> None:
    """The rounds that disagree, so that a reader knows the machine was disturbed while timing."""
    if len(rounds_ms) > 1 and max(rounds_ms) > SPREAD_NOTED * min(rounds_ms):
        ctx.say(f"timing rounds of the {what} ranged {min(rounds_ms):.3f}-{max(rounds_ms):.3f} ms (other work "
                f"on the machine): the median, {float(np.median(rounds_ms)):.3f} ms, is reported")

