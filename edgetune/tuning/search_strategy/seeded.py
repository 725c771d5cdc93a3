"""Sibling-seeded search: the siblings' best schedules of a task are measured first (see
`edgetune.tuning.transfer.siblings`), then the recipe's search strategy takes over."""

from __future__ import annotations

import tvm_ffi
from tvm.ir import IRModule
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir.meta_schedule.search_strategy import PySearchStrategy

from edgetune.tuning.analyzer.tir import BALANCED, core_balance, parallel_extent
from edgetune.tuning.measurements import FAILED, mean_seconds, measure_candidate
from edgetune.tuning.transfer.siblings import SiblingSchedule, TransferStats


@derived_object
class SeededSearch(PySearchStrategy):
    """Measures the siblings' best schedules of the task first, then hands over to `inner`.

    A round measures the seeds this build has not measured yet, best first, as many as its trials allow
    (a first pass cut to fit its share of the budget may give a task fewer), so a task's next round starts
    with the rest. Seeds are skipped when the device's store held records of the task before this
    build touched it (a resumed build measured them already), and those that leave cores idle where another
    keeps them busier (`_balanced_where_possible`). `inner` gets the rest of the round's trials and sees the seeds'
    measurements in the database like any other record.
    """

    def __init__(self, inner, seeds: dict[int, list[SiblingSchedule]], stats: TransferStats):
        self.inner = inner
        self.seeds = seeds
        self.stats = stats

    def _initialize_with_tune_context(self, context) -> None:
        self.inner._initialize_with_tune_context(context)
        self.context = context

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        mod, task = self.context.mod, str(self.context.task_name)
        self.queue: list[Schedule] = []
        taken = self.stats.seeds_taken.get(task, 0)
        resumed = task not in self.stats.seeds_taken and database is not None and database.has_workload(mod) and len(
            database.get_top_k(database.commit_workload(mod), 1)) > 0
        seeds = self.seeds.get(tvm_ffi.structural_hash(mod), [])
        if not resumed and taken < len(seeds):
            self.queue = measurable_seeds(mod, seeds, list(self.context.space_generator.postprocs),
                                          int(self.context.num_threads))
        self.queue = self.queue[taken:][: int(max_trials)]
        self.seeding = False
        self.inner.pre_tuning(int(max_trials) - len(self.queue), num_trials_per_iter, design_spaces, database,
                              cost_model)

    def generate_measure_candidates(self):
        if self.queue:
            batch, self.queue = self.queue, []
            self.seeding = True
            return [measure_candidate(s) for s in batch]
        return self.inner.generate_measure_candidates()

    def notify_runner_results(self, measure_candidates, results) -> None:
        if not self.seeding:
            self.inner.notify_runner_results(measure_candidates, results)
            return
        self.seeding = False
        task = str(self.context.task_name)
        self.stats.seeds_taken[task] = self.stats.seeds_taken.get(task, 0) + len(results)
        seconds = [mean_seconds(r.run_secs) for r in results if r.error_msg is None and r.run_secs]
        if seconds and min(seconds) < min(FAILED, self.stats.seed_best.get(task, FAILED)):
            self.stats.seed_best[task] = min(seconds)

    def post_tuning(self) -> None:
        self.inner.post_tuning()

    def clone(self) -> SeededSearch:
        return SeededSearch(self.inner.clone(), self.seeds, self.stats)


def measurable_seeds(mod: IRModule, seeds: list[SiblingSchedule], postprocs: list, cores: int) -> list[Schedule]:
    """The task's seeds a build measures, best first: those that replay here, one of each program (two traces
    may post-process to the same one), without those that leave cores idle (`_balanced_where_possible`). A task
    may so measure fewer seeds than the siblings hold; its rounds' search takes the trials left."""
    schedules: list[Schedule] = []
    programs: set[int] = set()
    for i, seed in enumerate(seeds):
        schedule = seed.replay(mod, postprocs, seed=i + 1)
        if schedule is None:  # does not replay here
            continue
        program = tvm_ffi.structural_hash(schedule.mod)
        if program not in programs:
            programs.add(program)
            schedules.append(schedule)
    return _balanced_where_possible(schedules, cores)


def _balanced_where_possible(schedules: list[Schedule], cores: int) -> list[Schedule]:
    """The schedules without those that leave more of the device's cores idle than another does, up to
    BALANCED (`core_balance`): a sibling with fewer cores ranks them well, but here they leave cores idle (a
    convolution's four seeds from a 1-core sibling ran at 562, 618, 1070 and 1076 us on two cores, the last two
    single-threaded; a Winograd product's seed of 3 parallel iterations at 325 us, where one of 42 ran at 200)."""
    balance = [core_balance(parallel_extent(s.mod), cores) for s in schedules]
    enough = min(BALANCED, max(balance, default=0.0))
    return [s for s, b in zip(schedules, balance) if b >= enough]
