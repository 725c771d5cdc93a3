"""Search strategies: which candidates a task measures next (MetaSchedule's SearchStrategy seam)."""

from __future__ import annotations

from tvm.s_tir import meta_schedule as ms

from edgetune.profiles import Hardware
from edgetune.tuning.search_strategy.draft_verify import (
    DRAFT_VERIFY_ROUND,
    DraftVerifySearch,
    SearchCounts,
    TrustsPrior,
)

_POPULATION_PER_TRIAL = 8  # MetaSchedule's defaults: a population of 512 for 64 trials per round
_MIN_POPULATION = 64


def _evolutionary_search(round_trials: int):
    """MetaSchedule's stock search with its population sized to the round it picks for.

    Each round evolves the whole population whatever it measures (~40 s at TVM's 512 on a Winograd
    convolution here, against ~10 s to build and measure 8 candidates), so a round of 8 trials, as
    in the first pass over a model's tasks, evolves 64 instead: TVM's ratio of 512 for 64."""
    population = max(_MIN_POPULATION, min(512, _POPULATION_PER_TRIAL * round_trials))
    return ms.search_strategy.EvolutionarySearch(population_size=population,
                                                 init_min_unmeasured=min(50, population))


def round_trials_under_budget(name: str, default: int) -> int:
    """Trials of one round of a task under a time budget: smaller rounds let the task scheduler follow
    where the model's time is; each costs a population evolved afresh for the stock search, little for
    draft-verify (see DRAFT_VERIFY_ROUND)."""
    return DRAFT_VERIFY_ROUND if name == "draft-verify" else default


def create(name: str, *, round_trials: int, hardware: Hardware | None, device: str, isa: str,
           counts: SearchCounts, prior: TrustsPrior | None = None) -> ms.search_strategy.SearchStrategy:
    """The search strategy a recipe names ("evolutionary" or "draft-verify") for a round of `round_trials`."""
    if name == "evolutionary":
        return _evolutionary_search(round_trials)
    if name == "draft-verify":
        if hardware is None:
            raise ValueError("draft-verify search needs the device profile's hardware numbers")
        return DraftVerifySearch(hardware, device, isa, counts=counts, prior=prior)
    raise ValueError(f"unknown search strategy {name!r}")  # the recipe schema admits no other
