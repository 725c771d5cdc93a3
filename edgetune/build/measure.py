"""Stage: measure. The packaged library, the same model untuned, and the reference, timed where the
device is: on this machine, or on the device over RPC (where the reference cannot run)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgetune.build.context import TargetBuild
from edgetune.runtime import SLEEPING_COST_ACCEPTED, TIMING_ROUNDS, ThreadWait, each_in_turns, thread_wait_policy

SPREAD_NOTED = 1.1
"""Rounds further apart than this (slowest / fastest) are reported."""


@dataclass(frozen=True)
class ThreadWaitChoice:
    """How the artifact's CPU threads wait for work, and the tuned model's idle latencies (ms, medians of the
    rounds) with its threads spinning and sleeping that chose it."""

    policy: ThreadWait
    spinning_ms: float
    sleeping_ms: float


@dataclass(frozen=True)
class Latency:
    """Milliseconds (None: not measured) and where they were measured (None: nowhere)."""

    tuned: float | None = None
    untuned: float | None = None
    reference: float | None = None
    measured_on: str | None = None
    thread_wait: ThreadWaitChoice | None = None  # None: TVM's default (spinning), not measured

    def as_manifest(self) -> dict[str, float | None]:
        """The manifest's `latency_ms`; the reference keeps the key it has always had."""
        return {"tuned": self.tuned, "untuned": self.untuned, "onnxruntime": self.reference}


def measure_stage(ctx: TargetBuild, library: Path, samples: dict[str, np.ndarray],
                  untuned: Path | None = None) -> Latency:
    """Time the tuned and the untuned model on the target's device; the reference only beside them here.
    `untuned`: the untuned model's library when the compile stage built it already."""
    device = ctx.device
    if not device.can_measure:
        return Latency()
    if device.runs_here:
        ctx.say(f"timing tuned, untuned and {ctx.reference.display_name}")
    else:
        ctx.say(f"timing tuned and untuned on the device ({device.where})")
    inputs = ctx.sample_list(samples)
    thread_wait, reference_ms = None, None
    with device.thread_wait_timers(library, inputs) as timers:  # its processes start beside the compile
        untuned = untuned or _untuned_library(ctx, device.export_function())
        if device.runs_here:
            threads = ctx.profile.hardware.cores or 1
            ours = timers or {"tuned": lambda: device.latency_ms(library, inputs)}
            rounds = each_in_turns({**ours, "reference": lambda: ctx.reference.time(samples, threads=threads)},
                                   TIMING_ROUNDS)
            thread_wait = _thread_wait(ctx, rounds["spin"], rounds["sleep"]) if timers else None
            tuned_ms, reference_ms = rounds[thread_wait.policy if thread_wait else "tuned"], rounds["reference"]
            _say_spread(ctx, "tuned model", tuned_ms)
            _say_spread(ctx, ctx.reference.display_name, reference_ms)
        else:
            tuned_ms = [device.latency_ms(library, inputs)]
    return Latency(tuned=float(np.median(tuned_ms)), untuned=device.latency_ms(untuned, inputs),
                   reference=float(np.median(reference_ms)) if reference_ms else None, measured_on=device.where,
                   thread_wait=thread_wait)


def _thread_wait(ctx: TargetBuild, spinning_ms: list[float], sleeping_ms: list[float]) -> ThreadWaitChoice:
    """Whether the artifact's threads sleep while they wait for work: robust beside other busy processes, where
    spinning threads hand them the cores (runtime.SPIN_COUNT_ENV), unless it slows the model on the idle device.
    The tuned latency reported is then the one of the way it waits."""
    spinning, sleeping = float(np.median(spinning_ms)), float(np.median(sleeping_ms))
    choice = ThreadWaitChoice(thread_wait_policy(spinning, sleeping), spinning, sleeping)
    cost = f"{sleeping:.3f} ms with them sleeping against {spinning:.3f} ms spinning"
    if choice.policy == "sleep":
        ctx.say(f"the artifact's threads sleep while they wait for work ({cost}): other busy processes "
                "keep their share of the cores")
    else:
        ctx.say(f"the artifact's threads spin while they wait for work ({cost}, more than "
                f"{SLEEPING_COST_ACCEPTED:.2f}x): beside other busy processes it slows down more")
    return choice


def _say_spread(ctx: TargetBuild, what: str, rounds_ms: list[float]) -> None:
    """The rounds that disagree, so that a reader knows the machine was disturbed while timing."""
    if len(rounds_ms) > 1 and max(rounds_ms) > SPREAD_NOTED * min(rounds_ms):
        ctx.say(f"timing rounds of the {what} ranged {min(rounds_ms):.3f}-{max(rounds_ms):.3f} ms (other work "
                f"on the machine): the median, {float(np.median(rounds_ms)):.3f} ms, is reported")


def _untuned_library(ctx: TargetBuild, cross_compiler: Callable | None) -> Path:
    from edgetune.compile import compile_model, export_library

    executable = compile_model(ctx.relax_mod, ctx.tvm_target, None, ctx.winograd)
    return export_library(executable, ctx.work_dir / "untuned.so", cross_compiler)
