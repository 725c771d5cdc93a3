"""Draft-then-verify search (Pruner, ASPLOS 2025) as a MetaSchedule search strategy.

Each round:
1. draft: a genetic search over each design space's *decision vectors*, scored by the
   symbol-based analyzer only (numpy, thousands of candidates in milliseconds): random samples,
   the best measured records of the task, the previous round's drafts, and their mutations and
   crossovers, for `generations` generations; the best `drafts` unmeasured ones are kept,
   taken from the design spaces in turn;
2. verify: the best `verify` drafts are materialized (TVM replays the trace and runs the space
   generator's postprocessors) and scored by the learned cost model, whose rank is blended with
   the analyzer's: it counts from LEARNED_FROM measurements of the task on and as much as the
   analyzer from LEARNED_FULL on (few measurements train a ranker worse than the analyzer);
3. select: the batch is picked greedily by that score with a bonus for decision values not
   measured yet and for design spaces measured less than the others (no duplicates), and an
   epsilon share of it at random from the verified drafts;
4. measure (TVM's builder and runner); the learned model keeps the measurements (MetaSchedule's
   UpdateCostModel callback) and learns them before it next ranks (RankingCostModel.fit_if_stale).

The first batches are smaller (FIRST_BATCHES) so the analyzer's best arrive early. Design spaces the
analyzer cannot read structurally are drafted with TVM's own sampling and mutators and scored
by the analyzer's TIR walk on the materialized candidates (slower, same selection); a space with no
decision at all (a transpose, a reshape, BatchNorm + ReLU) has one design, measured once. Should the
analyzer fail on a task or score none of its candidates, the task's remaining trials go to
MetaSchedule's evolutionary search. Each of these fallbacks is counted (`SearchCounts.fallback`).
"""

from __future__ import annotations

import hashlib
import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.arg_info import ArgInfo
from tvm.s_tir.meta_schedule.search_strategy import MeasureCandidate, PySearchStrategy
from tvm.s_tir.schedule import Trace

from edgetune.profiles import Hardware
from edgetune.tuning.analyzer import SpaceModel, UnsupportedSpace, make_analyzer, nests_from_func
from edgetune.tuning.analyzer.space import replay
from edgetune.tuning.cost_model.ranking import rank

logger = logging.getLogger(__name__)

LEARNED_FROM, LEARNED_FULL = 16, 128
"""Measurements of the task after which the learned model's rank starts to count in the verify
score, and after which it counts as much as the analyzer's. Measured here on two kernels: an
XGBoost ranker trained on 8-64 measurements ranks the analyzer's best drafts worse than the
analyzer does (Spearman 0.0-0.3 vs 0.4-0.5); with ~128 the blend beats either alone."""
FIRST_BATCHES = (8, 16)
"""Sizes of the first batches (capped by the scheduler's batch size): the analyzer's best few are
measured first so that a good latency arrives early and the learned model counts sooner."""
DRAFT_VERIFY_ROUND = sum(FIRST_BATCHES)
"""A round of one task under a time budget: its first batches. In a 10-minute ResNet-50 build with rounds
of 64 (batches of 8, 16 and 40), a round's first 24 trials gave most of what its 64 gained on 8 of the 10
rounds that gained, in 40% of its seconds; and with 28 tasks only 12 rounds fitted after the first pass, so three
tasks called 3 times per inference kept their first pass's schedules while tasks called once had a round more."""
ANALYZER_RESOLUTION = 0.1
"""Analyzer estimates within this relative distance count as ties (its error is larger), so
among near-equal drafts the diversity bonus decides."""
DIVERSITY_BONUS = 0.15
"""Score bonus (on a 0..1 rank scale) for a candidate whose decision values are all new and whose
design space has had less than its share of measurements (half each)."""
VERIFY_CPU, VERIFY_GPU = 160, 64
"""Drafts materialized and verified per round by default. TVM's GPU postprocessors (which lower
the candidate to verify it) cost ~20x the CPU ones per candidate, hence fewer on GPUs."""
UNLEARNED_VERIFY_PER_TRIAL = 4
"""While the learned model does not count yet (fewer than LEARNED_FROM measurements of the task, no trusted
prior), a round materializes this many drafts per candidate of its batch instead of `verify`: the score is
the analyzer's alone, and 160 materializations plus the learned model's features took about 2 s of each
such round on a ResNet-18 convolution here."""
FALLBACK_PER_TRIAL, FALLBACK_SAMPLES = 4, 48
"""Candidates the fallback spaces materialize (TVM sampling + mutation) per candidate of a batch, all of them
together, and at most per space and batch. Each is a replay with the postprocessors: 48 per space and batch,
as it was, were 30% of a 4-minute ResNet-18 build's py-spy samples (its Winograd tasks: no space read
structurally). Drafts left unmeasured stay in the space's pool for the next batch."""
STOCK_POPULATION = 64
"""Population of the evolutionary search a task falls back to (MetaSchedule's ratio for rounds of 8)."""
NO_DECISION = "no tunable decision"
SHORTEST_S, LONGEST_S = 1e-12, 1e6
"""Analyzer estimates are clipped into this range before their logarithm (a zero or non-finite one
would otherwise tie every draft or poison the ranks)."""


@dataclass
class _Draft:
    space: int
    key: bytes
    latency: float  # analyzer estimate, seconds
    row: np.ndarray | None = None
    schedule: Schedule | None = None


@dataclass
class _Space:
    schedule: Schedule
    model: SpaceModel | None  # None: analyzed by the TIR walk on materialized candidates
    weights: np.ndarray | None = None
    drafts: np.ndarray | None = None
    seen: list[set[int]] = field(default_factory=list)  # per slot: decision indices measured
    measured: int = 0  # candidates of this space measured so far
    pool: list[_Draft] = field(default_factory=list)  # a fallback space's materialized drafts, not measured yet


@dataclass
class SearchCounts:
    """Candidates per stage, summed over rounds: what drafting saved the learned model."""

    explored: int = 0  # decision vectors (or fallback candidates) scored by the analyzer
    drafted: int = 0  # kept by the analyzer for verification
    verified: int = 0  # materialized and scored by the learned model
    fallback: str | None = None  # why (part of) the task was not drafted by the structural analyzer


class TrustsPrior(Protocol):
    def trusted(self, key: str) -> bool: ...


@derived_object
class DraftVerifySearch(PySearchStrategy):
    """MetaSchedule search strategy: analyzer-drafted, cost-model-verified (see module doc)."""

    def __init__(
        self,
        hardware: Hardware,
        device: str = "cpu",
        isa: str = "x86_64",
        *,
        population: int = 2048,
        generations: int = 2,
        drafts: int = 512,
        verify: int | None = None,
        eps_greedy: float = 0.1,
        measured_seeds: int = 16,
        counts: SearchCounts | None = None,
        prior: TrustsPrior | None = None,
    ):
        self.hardware = hardware
        self.device = device
        self.isa = isa
        self.population = population
        self.generations = generations
        self.draft_count = drafts
        self.verify_count = verify if verify is not None else (VERIFY_CPU if device == "cpu" else VERIFY_GPU)
        self.eps_greedy = eps_greedy
        self.measured_seeds = measured_seeds
        self.counts = counts if counts is not None else SearchCounts()
        self.prior = prior  # a learned model transferred from sibling devices: weighed fully while trusted
        self.analyzer = make_analyzer(hardware, device, isa)

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context
        self.mod = context.mod
        self.threads = max(1, int(context.num_threads))  # the builder's workers wait while a batch is drafted
        seed = int(context.rand_state) if context.rand_state is not None else 0
        self.rng = np.random.default_rng(seed & 0x7FFFFFFF)
        self.postprocs = list(context.space_generator.postprocs)
        self.mutators = list(context.space_generator.mutator_probs.items())

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None) -> None:
        self.max_trials = int(max_trials)
        self.per_iter = int(num_trials_per_iter)
        self.database = database
        self.cost_model = cost_model
        self.trials = 0
        self.round = 0
        self.design_spaces = list(design_spaces)
        self.stock = None  # MetaSchedule's evolutionary search, once the analyzer failed on this task
        self.spaces = [self._read_space(schedule) for schedule in self.design_spaces]
        readable = [s.model for s in self.spaces if s.model is not None]
        if readable and all(model.width == 0 for model in readable) and self.counts.fallback is None:
            self.counts.fallback = NO_DECISION
        self.measured: set[bytes] = set()
        # Two decision vectors can give the same program (e.g. a split of a unit loop): never measure twice.
        self.measured_programs: set[int] = set()
        self.pending: list[_Draft] = []
        self.workload = database.commit_workload(self.mod) if database is not None else None
        self._remember([record.trace for record in self._records(None)])

    def _read_space(self, schedule: Schedule) -> _Space:
        """A design space with its structural model, or without one (drafted by TVM's sampling)."""
        try:
            model = SpaceModel.analyze(self.mod, schedule)
            weights = model.mutation_weights()
        except UnsupportedSpace as reason:
            logger.info("design space not read structurally (%s): drafting with TVM's sampling", reason)
            self._note_fallback(f"analyzer cannot read a design space ({reason}): drafted by TVM's sampling")
            return _Space(schedule, None)
        except Exception as exc:  # an analyzer bug on an unusual space must not sink the task
            logger.warning("analyzer failed on a design space (%s: %s): drafting with TVM's sampling",
                           type(exc).__name__, exc)
            self._note_fallback(f"analyzer failed on a design space ({type(exc).__name__}: {exc}): "
                                "drafted by TVM's sampling")
            return _Space(schedule, None)
        return _Space(schedule, model, weights=weights, seen=[set() for _ in model.slots])

    def _note_fallback(self, reason: str) -> None:
        if self.counts.fallback is None or self.counts.fallback == NO_DECISION:
            self.counts.fallback = reason

    def post_tuning(self) -> None:
        if self.stock is not None:
            self.stock.post_tuning()
        self.spaces = []
        self.pending = []

    def clone(self) -> DraftVerifySearch:
        return DraftVerifySearch(
            self.hardware,
            self.device,
            self.isa,
            population=self.population,
            generations=self.generations,
            drafts=self.draft_count,
            verify=self.verify_count,
            eps_greedy=self.eps_greedy,
            measured_seeds=self.measured_seeds,
            counts=self.counts,
            prior=self.prior,
        )

    def generate_measure_candidates(self) -> list[MeasureCandidate] | None:
        if self.trials >= self.max_trials:
            return None
        batch = min(self.per_iter, self.max_trials - self.trials)
        if self.round < len(FIRST_BATCHES):
            batch = min(batch, FIRST_BATCHES[self.round])
        self.round += 1
        if self.stock is not None:
            return self.stock.generate_measure_candidates()
        try:
            picked = self._select(self._verify(self._draft(batch), batch), batch)
        except Exception as exc:  # the stock search takes over the task's remaining trials
            return self._fall_back(f"analyzer failed ({type(exc).__name__}: {exc})")
        if not picked and self.estimated and not self.finite:
            return self._fall_back("the analyzer scored none of the candidates")
        if not picked:
            return None
        self.pending = picked
        return [MeasureCandidate(d.schedule, ArgInfo.from_entry_func(d.schedule.mod, remove_preproc=True))
                for d in picked]

    def _fall_back(self, reason: str) -> list[MeasureCandidate] | None:
        """MetaSchedule's evolutionary search for the rest of this task's trials (counted, logged)."""
        logger.warning("draft-verify on %s: %s; evolutionary search takes over", self.context.task_name, reason)
        self.counts.fallback = f"{reason}: evolutionary search"
        self.pending = []
        self.stock = ms.search_strategy.EvolutionarySearch(population_size=STOCK_POPULATION,
                                                           init_min_unmeasured=STOCK_POPULATION // 2)
        self.stock._initialize_with_tune_context(self.context)
        self.stock.pre_tuning(max(0, self.max_trials - self.trials), self.per_iter, self.design_spaces,
                              self.database, self.cost_model)
        return self.stock.generate_measure_candidates()

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.trials += len(results)
        if self.stock is not None:
            self.stock.notify_runner_results(measure_candidates, results)
            return
        for draft in self.pending:
            self.measured.add(draft.key)
            self.measured_programs.add(tvm_ffi.structural_hash(draft.schedule.mod))
            space = self.spaces[draft.space]
            space.measured += 1
            if draft.row is not None:
                for s, i in enumerate(draft.row):
                    space.seen[s].add(int(i))
        for space in self.spaces:
            space.pool = [d for d in space.pool if d.key not in self.measured]
        self.pending = []

    # -- draft --------------------------------------------------------------------------------

    def _draft(self, batch: int) -> list[_Draft]:
        """The best unmeasured candidates by the analyzer, taken from the design spaces in turn.

        Interleaving (each space's best, then each one's second best, ...) keeps every space in
        the verified pool: the analyzer's differences between spaces are within its error.
        """
        per_space: list[list[_Draft]] = []
        self.estimated = self.finite = 0  # this round's analyzer estimates, and the finite ones among them
        readable = [s for s in self.spaces if s.model is not None]
        share = max(64, self.population // max(1, len(readable)))
        best_rows = self._best_rows()
        fallback_spaces = len(self.spaces) - len(readable)
        for index, space in enumerate(self.spaces):
            if space.model is None:
                drafts = self._fallback_drafts(index, _fallback_samples(batch, fallback_spaces))
            else:
                drafts = self._evolve(index, space, share, best_rows[index])
            per_space.append(sorted(drafts, key=lambda d: d.latency))
        order = sorted((position, draft.latency, index) for index, drafts in enumerate(per_space)
                       for position, draft in enumerate(drafts))
        drafts = [per_space[index][position] for position, _, index in order][: self.draft_count]
        self.counts.drafted += len(drafts)
        return drafts

    def _evolve(self, index: int, space: _Space, size: int, best: np.ndarray) -> list[_Draft]:
        model = space.model
        assert model is not None and space.weights is not None
        if model.width == 0:  # one design: nothing to evolve
            return self._ranked(index, space, np.zeros((1, 0), dtype=np.int64))
        parts = [model.sample(self.rng, size)]
        if len(best):
            parts += [best, model.mutate(self.rng, np.repeat(best, max(1, size // (4 * len(best))), axis=0),
                                         space.weights)]
        if space.drafts is not None and len(space.drafts):
            parts.append(space.drafts)
        population = np.unique(np.concatenate(parts), axis=0)
        for _ in range(self.generations):
            self.counts.explored += len(population)
            latency = self.analyzer.latency(model.nests(population))
            elite = population[np.argsort(latency)[: max(8, size // 4)]]
            mothers = elite[self.rng.integers(0, len(elite), size)]
            fathers = elite[self.rng.integers(0, len(elite), size // 2)]
            children = model.mutate(self.rng, mothers, space.weights)
            crossed = model.crossover(self.rng, fathers, elite[self.rng.integers(0, len(elite), len(fathers))])
            population = np.unique(np.concatenate([elite, children, crossed]), axis=0)
        return self._ranked(index, space, population)

    def _ranked(self, index: int, space: _Space, population: np.ndarray) -> list[_Draft]:
        """The population's unmeasured vectors with a finite estimate, best first (kept for the next round)."""
        assert space.model is not None
        self.counts.explored += len(population)
        latency = self.analyzer.latency(space.model.nests(population))
        self.estimated += len(latency)
        self.finite += int(np.isfinite(latency).sum())
        order = np.argsort(latency)
        kept: list[_Draft] = []
        for i in order:
            if not np.isfinite(latency[i]):
                break
            key = _key(index, population[i])
            if key in self.measured:
                continue
            kept.append(_Draft(index, key, float(latency[i]), row=population[i]))
            if len(kept) >= self.draft_count:
                break
        space.drafts = np.array([d.row for d in kept]) if kept else None
        return kept

    def _fallback_drafts(self, index: int, samples: int) -> list[_Draft]:
        """TVM's sampling and mutators (`samples` candidates, half of them mutations of the best measured), scored
        by the analyzer's walk over the materialized TIR, and the space's pool of earlier batches' drafts."""
        space = self.spaces[index]
        traces = [Trace(space.schedule.trace.insts, {}) for _ in range(samples // 2)]
        records = self._records(self.measured_seeds)
        mutators = [m for m, _ in self.mutators]
        probs = np.array([float(p) for _, p in self.mutators])
        for k in range(samples - len(traces)):
            if not records or not mutators or not probs.sum() > 0:
                break
            base = records[k % len(records)].trace
            mutated = mutators[self.rng.choice(len(mutators), p=probs / probs.sum())].apply(base)
            if mutated is not None:
                traces.append(mutated)
        drafts = {d.key: d for d in space.pool}
        seeds = [int(self.rng.integers(1, 1 << 30)) for _ in traces]
        for schedule in self._in_parallel(lambda job: self._replay(*job), list(zip(traces, seeds))):
            if schedule is None:
                continue
            key = _key(index, None, schedule)
            if key in self.measured or key in drafts:
                continue
            nests = nests_from_func(_only_func(schedule))
            latency = float(self.analyzer.latency(nests)[0]) if nests else SHORTEST_S  # no statement: no work
            self.estimated += 1
            self.finite += math.isfinite(latency)
            self.counts.explored += 1
            drafts[key] = _Draft(index, key, latency, schedule=schedule)
        space.pool = sorted(drafts.values(), key=lambda d: d.latency)[:FALLBACK_SAMPLES]
        return list(space.pool)

    # -- verify and select --------------------------------------------------------------------

    def _verify(self, drafts: list[_Draft], batch: int) -> list[tuple[_Draft, float]]:
        """Materialize the best drafts and score them: analyzer's rank, plus the learned model's once it counts."""
        weight = self._learned_weight()
        wanted = self.verify_count if weight > 0 else min(self.verify_count, UNLEARNED_VERIFY_PER_TRIAL * batch)
        ready = self._materialized(drafts, wanted)
        self.counts.verified += len(ready)
        if not ready:
            return []
        drafted = rank(-tie_buckets([d.latency for d in ready]))
        learned = np.zeros(len(ready))
        if weight > 0 and self.cost_model is not None:
            candidates = [MeasureCandidate(d.schedule, ArgInfo.from_entry_func(d.schedule.mod, remove_preproc=True))
                          for d in ready]
            learned = np.asarray(self.cost_model.predict(self.context, candidates), dtype=float)
            learned = np.nan_to_num(learned, nan=0.0, posinf=0.0, neginf=0.0)  # an unusable score ranks nothing
        if np.ptp(learned) == 0:  # an untrained model scores everything alike
            weight = 0.0
        scores = drafted + weight * rank(learned)
        return list(zip(ready, scores))

    def _learned_weight(self) -> float:
        """How much the learned model's rank counts against the analyzer's (see LEARNED_FROM)."""
        if self.prior is not None and self.prior.trusted(str(tvm_ffi.structural_hash(self.mod))):
            return 1.0  # trained on the siblings' measurements of this task
        return float(np.clip((len(self.measured) - LEARNED_FROM) / (LEARNED_FULL - LEARNED_FROM), 0.0, 1.0))

    def _materialized(self, drafts: list[_Draft], wanted: int) -> list[_Draft]:
        """Up to `wanted` drafts, best first, built into distinct schedules never measured (in parallel)."""
        ready: list[_Draft] = []
        programs: set[int] = set()
        position = 0
        while len(ready) < wanted and position < len(drafts):
            chunk = drafts[position: position + max(wanted - len(ready), self.threads)]
            position += len(chunk)
            jobs = [(d, int(self.rng.integers(1, 1 << 30))) for d in chunk if d.schedule is None]
            for (draft, _), schedule in zip(jobs, self._in_parallel(self._materialize, jobs)):
                draft.schedule = schedule
            for draft in chunk:
                if draft.schedule is None or len(ready) >= wanted:
                    continue
                program = tvm_ffi.structural_hash(draft.schedule.mod)
                if program not in programs and program not in self.measured_programs:
                    programs.add(program)
                    ready.append(draft)
        return ready

    def _materialize(self, job: tuple[_Draft, int]) -> Schedule | None:
        draft, seed = job
        model = self.spaces[draft.space].model
        assert model is not None and draft.row is not None
        return model.materialize(self.mod, draft.row, self.postprocs, seed)

    def _in_parallel(self, function, jobs: list) -> list:
        """`function` over `jobs` on the tuning's cores: TVM replays a trace with Python's lock released."""
        if self.threads == 1 or len(jobs) < 2:
            return [function(job) for job in jobs]
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(function, jobs))

    def _select(self, scored: list[tuple[_Draft, float]], batch: int) -> list[_Draft]:
        """Greedy by score plus novelty of decision values; an epsilon share picked at random."""
        if not scored:
            return []
        drafts = [d for d, _ in scored]
        ranked = rank(np.array([s for _, s in scored]))
        explore = round(self.eps_greedy * batch)
        greedy = min(len(drafts), batch - explore)
        seen = [[set(s) for s in space.seen] for space in self.spaces]
        per_space = np.array([float(space.measured) for space in self.spaces])
        chosen: list[int] = []
        taken: set[bytes] = set()
        for _ in range(greedy):
            share = per_space * len(self.spaces) / max(1.0, per_space.sum())
            best, best_value = -1, -np.inf
            for i, draft in enumerate(drafts):
                if draft.key in taken:
                    continue
                novelty = 0.5 * _novelty(draft, seen[draft.space]) + 0.5 * max(0.0, 1.0 - share[draft.space])
                value = ranked[i] + DIVERSITY_BONUS * novelty
                if value > best_value:
                    best, best_value = i, value
            if best < 0:
                break
            chosen.append(best)
            taken.add(drafts[best].key)
            per_space[drafts[best].space] += 1
            if drafts[best].row is not None:
                for s, v in enumerate(drafts[best].row):
                    seen[drafts[best].space][s].add(int(v))
        rest = [i for i, d in enumerate(drafts) if d.key not in taken]
        for i in self.rng.permutation(rest)[: batch - len(chosen)]:
            chosen.append(int(i))
            taken.add(drafts[int(i)].key)
        return [drafts[i] for i in chosen]

    # -- records ------------------------------------------------------------------------------

    def _records(self, limit: int | None) -> list:
        """The task's measured records, best first (all of them when `limit` is None)."""
        if self.database is None or self.workload is None:
            return []
        if limit is None:
            return [r for r in self.database.get_all_tuning_records()
                    if tvm_ffi.structural_equal(r.workload.mod, self.mod)]
        return list(self.database.get_top_k(self.workload, limit))

    def _remember(self, traces: list[Trace]) -> None:
        """Mark measured traces so they are not drafted again: by decision vector where a space reads them,
        by program otherwise (see _PROGRAM_OF_TRACE)."""
        unread: list[Trace] = []
        for trace in traces:
            if not self._remember_decisions(trace):
                unread.append(trace)
        if not unread or all(space.model is not None for space in self.spaces):
            return
        task = tvm_ffi.structural_hash(self.mod)
        keys = [(task, hashlib.sha256(str(trace).encode()).digest()) for trace in unread]
        known = {i: _PROGRAM_OF_TRACE.get(key) for i, key in enumerate(keys)}
        missing = [i for i, program in known.items() if program is None]
        # a measured trace carries all its decisions: any seed replays it alike, and a fixed one keeps the
        # search's own random stream the same whether or not the cache knew the trace
        replayed = self._in_parallel(lambda i: self._replay(unread[i], seed=1), missing)
        for i, schedule in zip(missing, replayed):
            if schedule is not None:
                known[i] = _PROGRAM_OF_TRACE.put(keys[i], tvm_ffi.structural_hash(schedule.mod))
        for program in known.values():
            if program is not None:
                self.measured.update(_key(index, None, program=program) for index, space in enumerate(self.spaces)
                                     if space.model is None)

    def _remember_decisions(self, trace: Trace) -> bool:
        """Mark the trace's decision vector in the first readable space that encodes it; False if none does."""
        for index, space in enumerate(self.spaces):
            if space.model is not None:
                row = space.model.encode(trace)
                if row is not None:
                    self.measured.add(_key(index, row))
                    space.measured += 1
                    for s, i in enumerate(row):
                        space.seen[s].add(int(i))
                    return True
        return False

    def _best_rows(self) -> list[np.ndarray]:
        """Per readable space: decision vectors of the task's best measured records."""
        rows: list[list[np.ndarray]] = [[] for _ in self.spaces]
        for record in self._records(self.measured_seeds):
            for index, space in enumerate(self.spaces):
                if space.model is not None:
                    row = space.model.encode(record.trace)
                    if row is not None:
                        rows[index].append(row)
                        self.measured.add(_key(index, row))  # measured by another strategy (a sibling's seed)
                        break
        return [np.array(r, dtype=np.int64) if r else np.zeros((0, 0), dtype=np.int64) for r in rows]

    def _replay(self, trace: Trace, seed: int | None = None) -> Schedule | None:
        """`trace` on this task's module, postprocessed; `seed` drawn here unless given (a parallel replay's
        seeds are drawn in order beforehand, so the search stays deterministic)."""
        return replay(self.mod, trace, self.postprocs, seed if seed is not None else int(self.rng.integers(1, 1 << 30)))


def analyzer_best(context: ms.TuneContext, strategy: DraftVerifySearch, count: int) -> list[MeasureCandidate]:
    """The analyzer's `count` best drafts of a task nothing was measured of (`strategy`: the context's): what its
    first round would measure first, drafted without a database or a learned model, so that they are built with
    other tasks' candidates in one batch. None where the analyzer failed on the task (an empty list: its
    fallback, TVM's evolutionary search, needs the round's database)."""
    strategy.pre_tuning(count, count, context.space_generator.generate_design_space(context.mod), None, None)
    try:
        candidates = strategy.generate_measure_candidates()
        return [] if strategy.stock is not None or candidates is None else list(candidates)
    finally:
        strategy.post_tuning()


def _fallback_samples(batch: int, fallback_spaces: int) -> int:
    """New candidates per fallback space for a batch (FALLBACK_PER_TRIAL): at least a few per space."""
    return int(np.clip(math.ceil(FALLBACK_PER_TRIAL * batch / max(1, fallback_spaces)), 8, FALLBACK_SAMPLES))


def _key(space: int, row: np.ndarray | None, schedule: Schedule | None = None, program: int | None = None) -> bytes:
    """A draft's identity: its decision vector in a readable space, its program's hash in a fallback space."""
    if row is not None:
        return bytes([space]) + np.asarray(row, dtype=np.int64).tobytes()
    if program is None:
        assert schedule is not None
        program = tvm_ffi.structural_hash(schedule.mod)
    return bytes([space]) + b"h" + str(program).encode()


class _BoundedCache:
    """A dict that forgets its oldest entries past `capacity` (insertion order)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: dict[tuple[int, bytes], int] = {}

    def get(self, key: tuple[int, bytes]) -> int | None:
        return self.entries.get(key)

    def put(self, key: tuple[int, bytes], value: int) -> int:
        self.entries[key] = value
        if len(self.entries) > self.capacity:
            del self.entries[next(iter(self.entries))]
        return value


_PROGRAM_OF_TRACE = _BoundedCache(1 << 16)
"""(task's structural hash, digest of a measured trace's text) -> hash of the program its replay gives.
A fallback space's measured records are known by their programs, which takes a replay with the postprocessors;
each round of a task is a new strategy, which would replay them all again at its start (72 records by a Winograd
task's third round of 64; rounds under a budget are now 24 trials). A trace with its decisions replays to the
same program."""


def log_latency(latencies) -> np.ndarray:
    """Logarithms of analyzer estimates, clipped so that zero, inf and nan give finite values."""
    seconds = np.nan_to_num(np.asarray(latencies, dtype=float), nan=LONGEST_S, posinf=LONGEST_S)
    return np.log(np.clip(seconds, SHORTEST_S, LONGEST_S))


def tie_buckets(latencies) -> np.ndarray:
    """The tie bucket of each analyzer estimate (seconds): estimates within ANALYZER_RESOLUTION share one."""
    return np.floor(log_latency(latencies) / np.log1p(ANALYZER_RESOLUTION))


def _novelty(draft: _Draft, seen: list[set[int]]) -> float:
    if draft.row is None or not len(draft.row) or not seen:
        return 0.0
    return float(np.mean([int(v) not in s for v, s in zip(draft.row, seen)]))


def _only_func(schedule: Schedule):
    return next(iter(schedule.mod.functions.values()))
