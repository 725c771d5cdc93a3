"""A release: several recipes built in one command, one summary (release.json) and one page over every
(recipe, target), one exit code.

Every recipe is checked before anything is built, so a mistake in the tenth recipe costs no build of the
first nine. Serially (no --workers) each recipe is built as `edgetune build RECIPE` builds it. With workers,
each (recipe, target) is a unit of work (`edgetune.workers`): a unit starts once the targets whose records
warm-start it (its siblings, `pipeline.order_fleet`) have finished, and never while another unit writes its
record store (one owner per store); the targets of one recipe build side by side, each into its own
directories. Inside a unit, the tuning of a target measured over RPC is split into shards of its tasks on
the same workers (`edgetune.tuning.shards`). A unit writes no summary.json or report.html: when a recipe's
units are all done, those are written once, over all its targets.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import jinja2

from edgetune.errors import EdgetuneError, InputError
from edgetune.ownership import foreign_directory_problem, mark_owned, write_atomically
from edgetune.profiles import resolve_profile
from edgetune.recipe import Recipe, load_default_recipe, load_recipe
from edgetune.workers import Unit, UnitOutcome, WorkerSpec, open_executor

if TYPE_CHECKING:  # the pipeline imports TVM (seconds): loaded only once every recipe is checked
    from edgetune.pipeline import BuildResult, EventFn

RELEASE_JSON = "release.json"
RELEASE_PAGE = "release.html"
DEFAULT_RELEASE_DIR = Path("release")


@dataclass
class ReleaseRecipe:
    """One recipe of the release: its merged build result, or why it has none."""

    recipe: Recipe
    file: str  # as the user named it ("<default recipe>" without one)
    only: list[str] | None
    result: BuildResult | None = None
    error: str | None = None
    exit_code: int = 0

    def to_json(self) -> dict[str, Any]:
        result = self.result.to_json() if self.result else {"ok": False, "targets": {}}
        build_dir = self.recipe.output_dir / self.recipe.name
        return {"recipe": self.recipe.name, "file": self.file, "build_dir": str(build_dir),
                "ok": self.error is None and result["ok"], "error": self.error, "targets": result["targets"]}


@dataclass
class Release:
    recipes: list[ReleaseRecipe]
    workers: str
    wall_s: float = 0.0
    files: list[Path] = field(default_factory=list)

    def exit_code(self, strict: bool) -> int:
        """2 when any recipe met bad input, else 1 when any target failed (or, with strict, any task's tuning)."""
        codes = [0]
        for item in self.recipes:
            codes.append(item.exit_code)
            targets = item.result.targets.values() if item.result else []
            if any(t.error for t in targets) or (strict and any(t.tuning_failed for t in targets)):
                codes.append(1)
        return max(codes)

    def to_json(self, strict: bool) -> dict[str, Any]:
        code = self.exit_code(strict)
        return {"ok": code == 0, "exit_code": code, "workers": self.workers, "wall_s": round(self.wall_s, 3),
                "recipes": [item.to_json() for item in self.recipes]}


def load_release(files: list[Path], only: list[str] | None, release_dir: Path,
                 sign_key: Path | None) -> list[ReleaseRecipe]:
    """Every recipe loaded and every input checked, or one InputError listing every problem in every recipe."""
    problems: list[str] = []
    items: list[ReleaseRecipe] = []
    for file in files or [None]:
        try:
            recipe = load_recipe(file) if file is not None else load_default_recipe()  # messages name it as given
            if file is not None:  # relative paths in it resolve the same in every worker's working directory
                recipe = load_recipe(file.resolve())
        except InputError as exc:
            problems.append(str(exc))
            continue
        names = [t.name for t in recipe.fleet]
        chosen = [n for n in only if n in names] if only else None
        if chosen == []:
            continue
        items.append(ReleaseRecipe(recipe, str(file) if file is not None else "<default recipe>", chosen))
    if only:
        known = {t.name for item in items for t in item.recipe.fleet}
        problems += [f"--target {name}: in none of the recipes' fleets" for name in only if name not in known]
    problems += _directory_problems(items, release_dir)
    if sign_key is not None:
        from edgetune.package.signing import load_private_key

        try:
            load_private_key(sign_key)
        except InputError as exc:
            problems.append(str(exc))
    if problems:
        raise InputError(problems)
    return items


def _directory_problems(items: list[ReleaseRecipe], release_dir: Path) -> list[str]:
    """Two recipes writing one build directory, or a directory edgetune may not write into."""
    problems = []
    owners: dict[Path, str] = {}
    for item in items:
        build_dir = item.recipe.output_dir / item.recipe.name
        if build_dir in owners:
            problems.append(f"{item.file}: builds into {build_dir}, as {owners[build_dir]} does; give the recipes "
                            "different names or outputs")
        owners.setdefault(build_dir, item.file)
        targets = item.only or [t.name for t in item.recipe.fleet]
        problems += filter(None, map(foreign_directory_problem, [build_dir, *(build_dir / t for t in targets)]))
    problem = foreign_directory_problem(release_dir)
    return problems + ([f"--release-dir: {problem}"] if problem else [])


def run_release(items: list[ReleaseRecipe], workers: WorkerSpec | None, records_dir: Path | None,
                sign_key: Path | None, on_event: EventFn | None = None,
                on_unit: Callable[[str, str, UnitOutcome], None] | None = None) -> Release:
    """Build every recipe: in this process one after another (no workers), or as units on the workers."""
    from edgetune.pipeline import build

    started = time.monotonic()
    release = Release(items, workers.text if workers else "serial")
    if workers is None:
        for item in items:
            try:
                item.result = build(item.recipe, item.only, on_event, records_dir, sign_key)
            except EdgetuneError as exc:
                item.error, item.exit_code = str(exc), exc.exit_code
    else:
        _run_units(items, workers, records_dir, sign_key, on_unit or (lambda recipe, target, outcome: None))
    release.wall_s = time.monotonic() - started
    return release


@dataclass
class _Planned:
    unit: Unit
    item: ReleaseRecipe
    after: set[int]  # units that must finish first: its siblings' builds
    resources: set[str]  # its record store: one unit at a time writes it


def plan_units(items: list[ReleaseRecipe], records_dir: Path | None, sign_key: Path | None,
               task_workers: int = 1) -> list[_Planned]:
    """One unit per (recipe, target), each recipe's in tuning order, with the units each must wait for;
    `task_workers`: how many workers a unit may split its tuning over."""
    from edgetune.pipeline import order_fleet, record_locations

    planned: list[_Planned] = []
    for item in items:
        recipe = item.recipe
        profiles = {t.name: resolve_profile(t.profile, t.overrides) for t in recipe.fleet}
        order, siblings = order_fleet(recipe.fleet, profiles)
        stores = record_locations(recipe, None, records_dir)
        index_of: dict[str, int] = {}
        for target in order:
            if item.only is not None and target.name not in item.only:
                continue
            unit = Unit(len(planned), recipe, target.name, records_dir, sign_key, task_workers)
            after = {index_of[s] for s in siblings[target.name] if s in index_of}
            resources = {str(stores[target.name].directory)}
            planned.append(_Planned(unit, item, after, resources))
            index_of[target.name] = unit.index
    return planned


def _run_units(items: list[ReleaseRecipe], workers: WorkerSpec, records_dir: Path | None, sign_key: Path | None,
               on_unit: Callable[[str, str, UnitOutcome], None]) -> None:
    from edgetune.package.artifact import claim_build_directory

    for item in items:  # before units of one recipe race to create its directories
        claim_build_directory(item.recipe.output_dir / item.recipe.name,
                              item.only or [t.name for t in item.recipe.fleet])
    executor = open_executor(workers)
    planned = plan_units(items, records_dir, sign_key, executor.slots)
    finished: dict[int, UnitOutcome] = {}
    running: dict[int, _Planned] = {}
    busy: set[str] = set()
    waiting = list(planned)
    try:
        while waiting or running:
            for entry in [p for p in waiting if p.after <= finished.keys()]:
                if not entry.resources & busy:
                    executor.submit(entry.unit)
                    busy |= entry.resources
                    running[entry.unit.index] = entry
                    waiting.remove(entry)
            for outcome in executor.wait():
                entry = running.pop(outcome.index)
                busy -= entry.resources
                finished[outcome.index] = outcome
                on_unit(entry.item.recipe.name, entry.unit.target, outcome)
    finally:
        executor.close()
    for item in items:
        _merge(item, [(p.unit.target, finished[p.unit.index]) for p in planned if p.item is item])


def _merge(item: ReleaseRecipe, outcomes: list[tuple[str, UnitOutcome]]) -> None:
    """The recipe's result over all its units, as one serial build would have written it (summary and report)."""
    from edgetune.pipeline import BuildResult, TargetResult, write_summary_and_report

    recipe = item.recipe
    build_dir = recipe.output_dir / recipe.name
    item.result = BuildResult(recipe.name, str(build_dir))
    for target, outcome in outcomes:
        if outcome.summary is None:
            item.result.targets[target] = TargetResult(target, error=outcome.error)
            item.exit_code = max(item.exit_code, outcome.exit_code)
        else:
            item.result.targets[target] = TargetResult.model_validate(outcome.summary["targets"][target])
    if any(outcome.summary is not None for _, outcome in outcomes):
        write_summary_and_report(item.result)


def write_release(release: Release, release_dir: Path, strict: bool) -> list[Path]:
    """release.json and release.html in `release_dir` (a directory edgetune creates and marks as its own)."""
    mark_owned(release_dir)
    summary = release.to_json(strict)
    json_path = release_dir / RELEASE_JSON
    write_atomically(json_path, json.dumps(summary, indent=2) + "\n")
    page = release_dir / RELEASE_PAGE
    write_atomically(page, render_release_page(summary, release_dir.resolve()))
    release.files = [json_path, page]
    return release.files


_PAGE = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string("""<!doctype html>
<html><head><meta charset="utf-8"><title>edgetune release</title>
<style>body{font-family:sans-serif;margin:2em}td,th{padding:.2em .8em;text-align:left}.bad{color:#b00}</style>
</head><body><h1>edgetune release: {{ "ok" if ok else "failed" }}</h1>
<p>{{ count }} targets of {{ recipes|length }} recipes, workers: {{ workers }}, {{ "%.1f"|format(wall_s) }} s</p>
<table><tr><th>recipe</th><th>target</th><th>status</th><th>tuned ms</th><th>verified</th><th>trials (new)</th>
<th>artifact</th></tr>
{% for r in recipes %}{% if r.error %}<tr class="bad"><td><a href="{{ r.report }}">{{ r.name }}</a></td><td>-</td>
<td colspan="5">{{ r.error }}</td></tr>{% endif %}{% for t in r.targets %}<tr{% if t.error %} class="bad"{% endif %}>
<td><a href="{{ r.report }}">{{ r.name }}</a></td><td>{{ t.name }}</td><td>{{ t.error or "ok" }}</td>
<td>{{ t.latency }}</td><td>{{ "yes" if t.verified else t.verification }}</td><td>{{ t.trials }}</td>
<td>{% if t.artifact %}<a href="{{ t.artifact }}">{{ t.artifact_name }}</a>{% endif %}</td></tr>
{% endfor %}{% endfor %}</table></body></html>
""")


def render_release_page(summary: dict[str, Any], release_dir: Path) -> str:
    """The page over every (recipe, target); every name and path enters as data, escaped by the template."""
    recipes = []
    for r in summary["recipes"]:
        targets = [{
            "name": name, "error": t["error"], "verified": t["verified"], "verification": t["verification"],
            "latency": f"{t['latency_ms']:.3f}" if t["latency_ms"] is not None else "-",
            "trials": f"{t['trials_total']} ({t['trials_measured']})",
            "artifact": _link(t["artifact"], release_dir) if t["artifact"] else None,
            "artifact_name": Path(t["artifact"]).name if t["artifact"] else None,
        } for name, t in r["targets"].items()]
        report = _link(str(Path(r["build_dir"]) / "report.html"), release_dir)
        recipes.append({"name": r["recipe"], "error": r["error"], "report": report, "targets": targets})
    return _PAGE.render(ok=summary["ok"], workers=summary["workers"], wall_s=summary["wall_s"], recipes=recipes,
                        count=sum(len(r["targets"]) for r in recipes))


def _link(path: str, release_dir: Path) -> str:
    return quote(os.path.relpath(path, release_dir), safe="/")

