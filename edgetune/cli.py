"""The `edgetune` command: parse arguments, call the pipeline, render results. No logic of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from edgetune.errors import EdgetuneError, InputError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tune a model for a fleet of edge devices with Apache TVM.")
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]
RecordsDirOption = Annotated[Optional[Path], typer.Option(
    "--records-dir", metavar="DIR",
    help="Where the devices' tuning records persist across builds (replaces the recipe's records_dir).")]


def _fail(exc: EdgetuneError) -> None:
    for line in str(exc).splitlines():
        err.print(f"[bold red]error:[/] {line}", markup=True, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@app.command()
def build(
    recipe: Annotated[Optional[Path], typer.Argument(
        help="The recipe YAML file; left out, the default recipe: ResNet-18 for this machine, into ./build.",
        show_default=False)] = None,
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="Build only this target (repeatable).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the machine-readable summary here.")] = None,
    rpc_tracker: Annotated[Optional[str], typer.Option(
        "--rpc-tracker", metavar="HOST:PORT",
        help="Measure the one target built through this RPC tracker (with --rpc-key; replaces its connection).",
    )] = None,
    rpc_key: Annotated[Optional[str], typer.Option(
        "--rpc-key", metavar="KEY", help="The key its device's server registered under at --rpc-tracker.")] = None,
    records_dir: RecordsDirOption = None,
) -> None:
    """Tune, compile, package and verify every target of RECIPE."""
    from edgetune.fleet.endpoints import override_connection
    from edgetune.pipeline import build as run_build
    from edgetune.recipe import load_default_recipe, load_recipe

    try:
        if recipe is None:
            out.print("no recipe given: building the default recipe (ResNet-18 for this machine) into ./build",
                      markup=False)
        chosen = load_recipe(recipe) if recipe is not None else load_default_recipe()
        loaded = override_connection(chosen, target, rpc_tracker, rpc_key)
        with _ProgressView(out) as progress:
            result = run_build(loaded, target, progress, records_dir)
    except EdgetuneError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        err.print("interrupted: every committed measurement is kept; run the same command again to resume")
        raise typer.Exit(130) from None
    _print_summary(result)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    raise typer.Exit(0 if result.ok else 1)


class _ProgressView:
    """Tuning progress: a live bar per target on a terminal, plain log lines otherwise (CI logs)."""

    def __init__(self, console: Console):
        self.console = console
        self.bars: dict[str, TaskID] = {}
        self.progress = None
        if console.is_terminal:
            self.progress = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console,
            )

    def __enter__(self) -> _ProgressView:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.progress:
            self.progress.stop()

    def __call__(self, event) -> None:
        if event.task is None:
            self.console.print(f"[{event.target}] {event.message}", markup=False)
            return
        p = event.task
        done = p.index - 1 + (p.trials_done / p.trials_planned if p.trials_planned else 1.0)
        best = f"{p.best_us:.1f} us" if p.best_us is not None else "-"
        detail = f"task {p.index}/{p.total} {p.task}: {p.trials_done}/{p.trials_planned} trials, best {best}"
        if self.progress is None:
            left = p.elapsed_s / done * (p.total - done) if done > 0 else None
            estimate = f", ~{left:.0f} s left" if left is not None else ""
            self.console.print(f"[{event.target}] {detail}, {p.elapsed_s:.0f} s{estimate}", markup=False)
            return
        if event.target not in self.bars:
            self.bars[event.target] = self.progress.add_task(escape(f"[{event.target}] tuning"), total=p.total,
                                                           detail="")
        self.progress.update(self.bars[event.target], completed=done, detail=escape(detail))


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _ratio(numerator: float | None, denominator: float | None, spec: str) -> str:
    return f"{numerator / denominator:{spec}}x" if numerator and denominator else "-"


def _print_summary(result) -> None:
    table = Table(title=f"edgetune build: {result.recipe}")
    for column in ("target", "tuned ms", "untuned ms", "ONNX Runtime ms", "vs untuned", "vs ORT", "verified",
                   "trials (new)"):
        table.add_column(column)
    for name, t in result.targets.items():
        if t.error:
            table.add_row(name, "-", "-", "-", "-", "-", "[red]failed[/]", f"{t.trials_total} ({t.trials_measured})")
            continue
        table.add_row(
            name, _ms(t.latency_ms), _ms(t.untuned_latency_ms), _ms(t.reference_latency_ms),
            _ratio(t.untuned_latency_ms, t.latency_ms, ".1f"), _ratio(t.reference_latency_ms, t.latency_ms, ".2f"),
            "[green]yes[/]" if t.verified else f"[yellow]{t.verification}[/]", f"{t.trials_total} ({t.trials_measured})",
        )
    out.print(table)
    for name, t in result.targets.items():
        line = f"{name}: failed: {t.error}" if t.error else f"{name}: {t.artifact}" + (" (reused)" if t.reused else "")
        out.print(line, markup=False, soft_wrap=True)
        if t.transfer and t.transfer["used"]:
            transfer = t.transfer
            out.print(f"{name}: transfer from {', '.join(transfer['sources'])}: {transfer['seeds_measured']} sibling "
                      f"schedules re-measured, still the best for {len(transfer['tasks_best_from_sibling'])} of "
                      f"{len(t.tasks)} tasks" + (f"; guard fell back for {', '.join(transfer['guard_fell_back'])}"
                                                 if transfer["guard_fell_back"] else ""), markup=False, soft_wrap=True)


@app.command()
def validate(recipe: RecipeArg) -> None:
    """Check RECIPE and the device profiles it names; needs no device."""
    from edgetune.recipe import load_recipe

    try:
        loaded = load_recipe(recipe)
    except EdgetuneError as exc:
        _fail(exc)
    out.print(f"{recipe}: ok ({len(loaded.fleet)} targets: {', '.join(t.name for t in loaded.fleet)})")


@app.command()
def targets() -> None:
    """List the device profiles edgetune knows."""
    from edgetune.profiles import list_profiles

    try:
        profiles = list_profiles()
    except EdgetuneError as exc:
        _fail(exc)
    table = Table(title="device profiles")
    for column in ("profile", "isa", "device", "peak GFLOPS", "description"):
        table.add_column(column)
    for p in profiles:
        peak = p.hardware.peak_gflops
        table.add_row(p.name, p.isa, p.device, f"{peak:.0f}" if peak else "-", p.description)
    out.print(table)


@app.command()
def verify(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory or its .tar.gz.")],
    rpc_tracker: Annotated[Optional[str], typer.Option(
        "--rpc-tracker", metavar="HOST:PORT", help="Run it on a device behind this RPC tracker (with --rpc-key).")] = None,
    rpc_key: Annotated[Optional[str], typer.Option("--rpc-key", metavar="KEY", help="The device's key.")] = None,
) -> None:
    """Check every checksum of ARTIFACT, then run it (here, or on a device over RPC) and compare with the
    reference output."""
    from edgetune.fleet.endpoints import RemoteDevice
    from edgetune.package.verify import verify_artifact

    try:
        remote = None
        if (rpc_tracker is None) != (rpc_key is None):
            raise InputError("--rpc-tracker and --rpc-key go together")
        if rpc_tracker is not None:
            host, _, port = rpc_tracker.rpartition(":")
            if not host or not port.isdigit():
                raise InputError(f"--rpc-tracker {rpc_tracker}: expected HOST:PORT")
            remote = RemoteDevice(host, int(port), rpc_key, timeout_s=120.0, compiler="")
        outcome = verify_artifact(artifact, remote)
    except EdgetuneError as exc:
        _fail(exc)
    for line in outcome.problems:
        err.print(f"[bold red]error:[/] {line}", soft_wrap=True)
    if outcome.output is not None:
        out.print(f"output vs reference: max abs difference {outcome.output.max_abs_error:.3g}: "
                  f"{'OK' if outcome.output.matches else 'MISMATCH'}")
    raise typer.Exit(0 if outcome.ok else 1)


@app.command()
def report(
    build_dir: Annotated[Path, typer.Argument(help="A build directory: <output>/<recipe>/.", show_default=False)],
) -> None:
    """Rebuild BUILD_DIR/report.html from the stored summary, manifests and tuning logs."""
    from edgetune.report import render_report

    try:
        path = render_report(build_dir)
    except EdgetuneError as exc:
        _fail(exc)
    out.print(str(path), markup=False, soft_wrap=True)


fleet_app = typer.Typer(no_args_is_help=True, help="Start, inspect and stop what RECIPE's targets are measured on.")
app.add_typer(fleet_app, name="fleet")


def _report(who: str, what: str) -> None:
    out.print(f"[{who}] {what}", markup=False, soft_wrap=True)


def _fleet_recipe(recipe: Path):
    from edgetune.recipe import load_recipe

    try:
        return load_recipe(recipe)
    except EdgetuneError as exc:
        _fail(exc)


def _fleet_done(problems: list[str]) -> None:
    for problem in problems:
        for line in problem.splitlines():
            err.print(f"[bold red]error:[/] {escape(line)}", markup=True, soft_wrap=True)
    raise typer.Exit(1 if problems else 0)


@fleet_app.command("up")
def fleet_up(recipe: RecipeArg) -> None:
    """Start the recipe's tracker (tracker: start: true) and, over SSH, each ssh target's RPC server."""
    from edgetune.fleet.provision import up

    _fleet_done(up(_fleet_recipe(recipe), _report))


@fleet_app.command("down")
def fleet_down(recipe: RecipeArg) -> None:
    """Stop what `fleet up` started for RECIPE (found by its pid files), and nothing else."""
    from edgetune.fleet.provision import down

    _fleet_done(down(_fleet_recipe(recipe), _report))


@fleet_app.command("status")
def fleet_status(recipe: RecipeArg) -> None:
    """Servers per key on each tracker, and each device's health; exit 1 when a target has no server."""
    from edgetune.fleet.status import fleet_status as gather
    from edgetune.fleet.tracker import TrackerSummary

    status = gather(_fleet_recipe(recipe))
    if status.local_tracker_pid is not None:
        out.print(f"[tracker] started by fleet up (pid {status.local_tracker_pid})", markup=False)
    for address, summary in status.trackers.items():
        if not isinstance(summary, TrackerSummary):
            err.print(f"[bold red]error:[/] {escape(summary)}", markup=True, soft_wrap=True)
            continue
        table = Table(title=f"tracker {address}")
        for column in ("key", "total", "free", "pending"):
            table.add_column(column)
        for key, servers in sorted(summary.keys.items()):
            table.add_row(key, str(servers.total), str(servers.free), str(servers.pending))
        out.print(table)
    for t in status.targets:
        line = f"[{t.name}] {t.connection}" + (f" via {t.tracker}" if t.tracker else "") + f": {t.health}"
        out.print(line if t.healthy else f"{line} (not ready)", markup=False, soft_wrap=True)
    raise typer.Exit(0 if status.ok else 1)


records_app = typer.Typer(no_args_is_help=True, help="Carry RECIPE's tuning records between machines.")
app.add_typer(records_app, name="records")


@records_app.command("export")
def records_export(
    recipe: RecipeArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .tar.gz to write.", show_default=False)],
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="Only this target (repeatable).")] = None,
    records_dir: RecordsDirOption = None,
) -> None:
    """Write the record stores of RECIPE's targets into one reproducible archive."""
    from edgetune.pipeline import record_locations
    from edgetune.tuning.records import export_stores

    try:
        locations = record_locations(_fleet_recipe(recipe), target, records_dir)
        present = {loc.directory.name: loc.directory for loc in locations.values() if loc.exists()}
        if not present:
            raise InputError(f"no tuning records yet for {', '.join(locations)} in "
                             f"{next(iter(locations.values())).directory.parent}")
        counts = export_stores(present, output)
    except EdgetuneError as exc:
        _fail(exc)
    for name, location in locations.items():
        store = location.directory.name
        line = f"{name}: {counts[store]} records ({store})" if store in counts else f"{name}: no records yet"
        out.print(line, markup=False)
    out.print(str(output), markup=False, soft_wrap=True)


@records_app.command("import")
def records_import(
    recipe: RecipeArg,
    archive: Annotated[Path, typer.Argument(help="A .tar.gz from `edgetune records export`.", show_default=False)],
    records_dir: RecordsDirOption = None,
) -> None:
    """Merge ARCHIVE's record stores into RECIPE's records directory; nothing local is removed."""
    from edgetune.pipeline import record_locations
    from edgetune.tuning.records import import_stores

    try:
        locations = record_locations(_fleet_recipe(recipe), None, records_dir)
        root = next(iter(locations.values())).directory.parent
        owners = {loc.directory.name: name for name, loc in locations.items()}
        imported = import_stores(archive, root)
    except EdgetuneError as exc:
        _fail(exc)
    for store in imported:
        owner = owners.get(store.name)
        who = f"{owner}" if owner else f"{store.name} (no target of this recipe has this profile and TVM target; kept)"
        out.print(f"{who}: {store.added} records added, {store.present} already here", markup=False, soft_wrap=True)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # progress must reach a CI log as it happens
    sys.exit(app())
