"""What a build produced: per target and for the recipe; `summary.json` and `--json` are made of these."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUMMARY_NAME = "summary.json"
"""Written beside the artifacts by every build: the same JSON as `--json`."""


@dataclass
class TargetResult:
    """What a build produced for one target."""

    name: str
    artifact: str | None = None
    artifact_dir: str | None = None
    latency_ms: float | None = None
    untuned_latency_ms: float | None = None
    reference_latency_ms: float | None = None
    verified: bool = False
    verification: str = "not run"  # "matched", "mismatch", or "not run: <why>"
    max_abs_error: float | None = None
    trials_measured: int = 0
    trials_total: int = 0
    tuning_s: float = 0.0  # tuning wall time in this build
    kept_for_selection_s: float = 0.0  # of the tuning budget, left to comparing schedules inside the model
    tasks: list[dict[str, Any]] = field(default_factory=list)
    tasks_total: int = 0
    reused: bool = False  # inputs unchanged: the packaged artifact was kept
    records: str | None = None  # the target's record store: relative to the build directory, or absolute
    transfer: dict[str, Any] | None = None  # what its siblings' records contributed (None: no siblings)
    selection: dict[str, Any] | None = None  # schedules compared inside the model (None: not done)
    tuning_failed: list[str] = field(default_factory=list)  # "<task>: <ExcType>: <message>"; kept their best so far
    device: dict[str, Any] | None = None  # arch, via ("local"/"rpc"), emulated, key: fleet.endpoints.device_summary
    error: str | None = None
    wall_s: float = 0.0


@dataclass
class BuildResult:
    """Every target of one recipe's build."""

    recipe: str
    output_dir: str
    targets: dict[str, TargetResult] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(t.error is None for t in self.targets.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "output_dir": self.output_dir,
            "ok": self.ok,
            "targets": {name: asdict(t) for name, t in self.targets.items()},
        }
