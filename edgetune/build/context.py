"""TargetBuild: what one target's stages share, built once per target (like MetaSchedule's TuneContext),
so the stages take one argument instead of a dozen positional ones."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgetune.build.untuned import UntunedModel, compile_apart_pays
from edgetune.devices import Device
from edgetune.frontend.model import LoadedModel
from edgetune.frontend.winograd import WinogradPolicy
from edgetune.profiles import DeviceProfile
from edgetune.recipe import FleetTarget, Recipe
from edgetune.reference import ReferenceRuntime
from edgetune.runtime import UNTUNED_TIMING_S
from edgetune.toolchains import Toolchain
from edgetune.tuning.database.store import RecordStore
from edgetune.tuning.shards import ShardPool
from edgetune.tuning.tune import TaskProgress

if TYPE_CHECKING:
    import tvm

    from edgetune.package.signing import Ed25519PrivateKey


@dataclass(frozen=True)
class Event:
    """A line of progress for whoever drives the build (the CLI prints these)."""

    target: str
    message: str
    task: TaskProgress | None = None


EventFn = Callable[[Event], None]


@dataclass(frozen=True)
class StoreLocation:
    """Where one target's records live; opened only when the target is built or read as a sibling."""

    directory: Path

    def exists(self) -> bool:
        return (self.directory / "database_tuning_record.json").is_file()


@dataclass
class TargetBuild:
    """One target of one recipe, with everything its stages read: the model (imported once per recipe),
    the device's profile, toolchain and the device itself (where its code runs), its record store and its
    siblings'."""

    recipe: Recipe
    target: FleetTarget
    profile: DeviceProfile
    toolchain: Toolchain
    model: LoadedModel
    relax_mod: Any  # tvm.IRModule; tvm is imported lazily (seconds)
    reference: ReferenceRuntime
    store: RecordStore
    sibling_stores: dict[str, StoreLocation]
    device: Device  # where its code runs: edgetune.devices.open_device
    emit: EventFn
    signer: Ed25519PrivateKey | None = None
    task_pool: ShardPool | None = None  # workers that tune shards of its tasks (a release's --workers)
    started: float = field(default_factory=time.monotonic)  # the budget counts from here (the model's import too)
    finish_reserve_s: float = 0.0
    """Of the budget, what the stages after the in-model comparison are expected to take (final compile,
    timing, package, verify); set once one compile and run of the model was timed (build/tune.py)."""
    ranks_that_fit: int | None = None
    """Under a budget, the candidate ranks whose in-model comparison fits its share of the budget; set with
    `finish_reserve_s` (build/tune.py). None: the recipe's `in_model_candidates`."""

    def say(self, message: str) -> None:
        """One progress line under this target's name."""
        self.emit(Event(self.target.name, message))

    @property
    def name(self) -> str:
        return self.target.name

    @cached_property
    def tvm_target(self) -> tvm.target.Target:
        return self.profile.tvm_target()

    @cached_property
    def winograd(self) -> WinogradPolicy | None:
        """The device's Winograd choices (tuning.winograd), from its profile's peak and bandwidth."""
        if not self.recipe.tuning.winograd:
            return None
        return WinogradPolicy(self.profile.hardware.peak_gflops, self.profile.hardware.memory_bandwidth_gbs)

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes of the model's weights: what a compile's memory and the exported library grow with."""
        from edgetune.selection import constant_bytes

        return constant_bytes(self.relax_mod)

    @cached_property
    def untuned(self) -> UntunedModel:
        """The untuned model's library, compiled once: a large model's in a process of its own beside a compile of
        this one, a small one's here."""
        return UntunedModel(self.relax_mod, self.tvm_target, self.winograd, self.work_dir / "untuned.so",
                            self.device.link_compiler, self.weight_bytes, self.say,
                            apart=compile_apart_pays(self.relax_mod, self.weight_bytes))

    @property
    def candidates(self) -> int:
        """Schedules per kernel compared inside the model: only where the model can be timed here, and under a
        budget only as many as fit in its share of it."""
        if not self.device.runs_here:
            return 1
        wanted = self.recipe.tuning.in_model_candidates
        return wanted if self.ranks_that_fit is None else min(wanted, self.ranks_that_fit)

    @property
    def times_thread_pool(self) -> bool:
        """Whether edgetune's thread pool (thread_pool.py) is built and timed as a third way for the artifact's
        threads to wait: on a CPU timed here, where the recipe leaves the way to the build."""
        return self.profile.device == "cpu" and self.device.runs_here and self.recipe.package.thread_wait == "auto"

    @property
    def comparison_cut_by_budget(self) -> bool:
        """Whether the budget's share left fewer schedules to compare inside the model than the recipe asks for."""
        return self.device.runs_here and self.candidates < self.recipe.tuning.in_model_candidates

    @property
    def budget_s(self) -> float | None:
        minutes = self.recipe.tuning.time_budget_min
        return minutes * 60 if minutes else None

    @property
    def budget_ends(self) -> float | None:
        """The `time.monotonic()` instant by which the whole target build should be done (None: no budget)."""
        return self.started + self.budget_s if self.budget_s is not None else None

    def budget_left_s(self) -> float | None:
        return self.budget_ends - time.monotonic() if self.budget_ends is not None else None

    @property
    def build_dir(self) -> Path:
        return self.recipe.output_dir / self.recipe.name

    @property
    def work_dir(self) -> Path:
        return self.build_dir / "work" / self.target.name

    @property
    def artifact_dir(self) -> Path:
        return self.build_dir / self.target.name

    @property
    def archive(self) -> Path:
        return self.build_dir / f"{self.target.name}.tar.gz"

    def sample_list(self, samples: dict) -> list:
        """The model's sample inputs in its input order."""
        return [samples[i.name] for i in self.model.inputs]

    def untuned_latency_ms(self, inputs: list) -> float:
        """The untuned model's latency on the target's device, timed once per build (by the budget's reserve, else
        the measure stage) and briefly: UNTUNED_TIMING_S."""
        return self.untuned.latency_ms(lambda library: self.device.latency_ms(library, inputs, UNTUNED_TIMING_S))
