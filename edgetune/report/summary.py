"""What a build produced: per target and for the recipe; `summary.json` and `--json` are made of these.

Defined in the report's layer because the report reads summaries and the build stages, a later layer,
fill them in. A release's worker sends its target's result
as this JSON, and the release parses it back with `TargetResult.model_validate`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

SUMMARY_NAME = "summary.json"
"""Written beside the artifacts by every build: the same JSON as `--json`."""


class TargetResult(BaseModel):
    """What a build produced for one target; the stages fill it in as they go."""

    name: str
    artifact: str | None = None
    artifact_dir: str | None = None
    latency_ms: float | None = None
    untuned_latency_ms: float | None = None
    reference_latency_ms: float | None = None
    thread_wait: dict[str, Any] | None = None
    """How the artifact's CPU threads wait for work ("spin", TVM's default, or "sleep"), with the tuned model's
    idle latencies both ways that chose it; None: not measured (TVM's default)."""
    verified: bool = False
    verification: str = "not run"  # "matched", "mismatch", or "not run: <why>"
    max_abs_error: float | None = None
    trials_measured: int = 0
    trials_total: int = 0
    tuning_s: float = 0.0  # tuning wall time in this build
    timings_disturbed: int = 0
    """Candidates whose timing other work on the machine disturbed (mean well above median): many of them
    say the machine was busy while tuning (measurements.TimingNoise)..."""
    timings_remeasured: int = 0
    """...those of them near their task's best, so measured again..."""
    timings_still_disturbed: int = 0
    """...and of those, the ones that no re-measurement gave undisturbed."""
    timings_on_fewer_threads: int = 0
    """Candidates timed on fewer threads than the target's cores, because other programs kept the rest busy
    (machine_load.py); their times are scaled to the target's threads."""
    timings_in_slow_windows: int = 0
    """Candidates timed while a reference kernel timed beside them ran well above its fastest time: the whole
    machine was slow, every run alike (tuning/slow_windows.py)..."""
    timings_retimed_quiet: int = 0
    """...those of them timed again once the machine read quiet (the lower of the two means is kept)..."""
    timings_still_slow: int = 0
    """...and those not timed in a quiet window after all (the machine stayed slow)."""
    builds_cut: int = 0
    """Candidates whose build ran far longer than the rest of their batch, killed and recorded as failed."""
    tuning_stopped_by: list[str] = []
    """What ended the tuning of its tasks: "time_budget" (tasks cut or skipped), "trials_per_task" (a task
    reached its trials), "search_space" (a search ran out of schedules it had not measured), "failed";
    empty when nothing was tuned."""
    kept_for_selection_s: float = 0.0  # of the tuning budget, left to comparing schedules inside the model and
    # to the stages after it (final compile, timing, package, verify)
    tuning_phases_s: dict[str, float] = {}
    """Seconds of the tuning by phase (tuning.tune.TuningResult.phases_s): "first_batch", "first_fits",
    "reserve", "rounds"; a phase the build did not run is absent (none with tuning split into shards)."""
    tuning_curve: list[tuple[float, float]] = []
    """(seconds of tuning, model milliseconds) after each round once every tuned task had a schedule, and at 0 s
    when every task had one from the records the build started with (a resumed build): the
    tuned kernels' summed time (weight x best) plus the rest of the model's time, which is the measured
    tuned latency minus that sum at the end (see `anchor_tuning_curve`). An estimate between its ends."""
    time_to_beat_reference_s: float | None = None
    """Seconds of tuning until the curve first ran below the reference's (ONNX Runtime's) latency; None when
    it never did, or when nothing was tuned or timed here; 0.0 when the records the build started with had
    it faster before any tuning here."""
    tasks: list[dict[str, Any]] = []
    tasks_total: int = 0
    reused: bool = False  # inputs unchanged: the packaged artifact was kept
    records: str | None = None  # the target's record store: relative to the build directory, or absolute
    transfer: dict[str, Any] | None = None  # what its siblings' records contributed (None: no siblings)
    selection: dict[str, Any] | None = None  # schedules compared inside the model (None: not done)
    selection_skipped: str | None = None  # why the comparison asked for was not done (the budget's share)
    tuning_failed: list[str] = []  # "<task>: <ExcType>: <message>"; kept their best so far
    device: dict[str, Any] | None = None  # arch, via ("local"/"rpc"), emulated, key: fleet.endpoints.device_summary
    stage_s: dict[str, float] = {}
    """Seconds each stage took, in order: "import" (the model's import, counted in the recipe's first target),
    "tune" (task extraction, sizing the budget's reserve, tuning), "compile" (the in-model comparison and the
    final compile), "measure", "package", "verify"; the stages a build ran."""
    error: str | None = None
    wall_s: float = 0.0

    def __init__(self, name: str, **fields: Any) -> None:
        """`TargetResult(name, ...)`, the target's name first, as the stages make one."""
        super().__init__(name=name, **fields)

    def anchor_tuning_curve(self) -> None:
        """Turns the tuner's kernel sums into model latencies once the tuned model has been timed: each point
        gets the part of the model's time no tuned kernel holds (untuned kernels, the VM's own work), taken
        as constant; then finds the first point below the reference's latency. Where the kernels, timed alone
        and cold, sum to more than the model took, every point is scaled down by that ratio instead: the
        curve ends at the measured latency either way."""
        if not self.tuning_curve or self.latency_ms is None:
            self.tuning_curve, self.time_to_beat_reference_s = [], None
            return
        last_ms = self.tuning_curve[-1][1]
        if last_ms > self.latency_ms:
            self.tuning_curve = [(seconds, kernels_ms * self.latency_ms / last_ms)
                                 for seconds, kernels_ms in self.tuning_curve]
        else:
            rest_ms = self.latency_ms - last_ms
            self.tuning_curve = [(seconds, kernels_ms + rest_ms) for seconds, kernels_ms in self.tuning_curve]
        reference = self.reference_latency_ms
        self.time_to_beat_reference_s = next(
            (seconds for seconds, model_ms in self.tuning_curve if reference is not None and model_ms < reference),
            None)


class BuildResult(BaseModel):
    """Every target of one recipe's build."""

    recipe: str
    output_dir: str
    targets: dict[str, TargetResult] = {}

    def __init__(self, recipe: str, output_dir: str, **fields: Any) -> None:
        super().__init__(recipe=recipe, output_dir=output_dir, **fields)

    @property
    def ok(self) -> bool:
        return all(t.error is None for t in self.targets.values())

    def to_json(self) -> dict[str, Any]:
        """summary.json's object: `ok` between the build directory and the targets, as it has always been."""
        return {
            "recipe": self.recipe,
            "output_dir": self.output_dir,
            "ok": self.ok,
            "targets": {name: t.model_dump() for name, t in self.targets.items()},
        }
