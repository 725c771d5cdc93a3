"""The `edgetune` command: parse arguments, call the pipeline, render results. No logic of its own."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from edgetune.errors import EdgetuneError, InputError
from edgetune.isolated import keep_torch_out
from edgetune.yamlsource import read_yaml

COMMAND_STARTED = time.monotonic()
"""A build's budget counts from here: importing TVM and reading the model are part of the command's time."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tune a model for a fleet of edge devices with Apache TVM.")
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]
RecordsDirOption = Annotated[Optional[Path], typer.Option(
    "--records-dir", metavar="DIR",
    help="Where the devices' tuning records persist across builds (replaces the recipe's records_dir).")]


_RUNS_AS_COMMAND = False
"""True in the `edgetune` command's process (main()), which may refuse imports it will never need."""

MAX_ERROR_LINES = 50
"""Problems printed before the rest are counted: 200,000 copies of one mistake help nobody."""


def _fail(exc: EdgetuneError) -> None:
    lines = str(exc).splitlines()
    for line in lines[:MAX_ERROR_LINES]:
        err.print(f"[bold red]error:[/] {escape(line)}", markup=True, soft_wrap=True)
    if len(lines) > MAX_ERROR_LINES:
        err.print(f"[bold red]error:[/] ... and {len(lines) - MAX_ERROR_LINES} more problems", markup=True)
    raise typer.Exit(exc.exit_code)


def _command(typer_app: typer.Typer, *args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
    """`typer_app.command(...)` with the one place where an EdgetuneError becomes its message and exit code
    (2: bad input, 1: a build or check that failed), instead of a try/except in every command."""
    def register(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*call_args: Any, **call_kwargs: Any) -> Any:
            if "recipes" in call_kwargs:
                _keep_torch_out_unless_needed(call_kwargs["recipes"] or [None])
            else:
                _keep_torch_out_unless_needed([call_kwargs.get("recipe")])
            try:
                return function(*call_args, **call_kwargs)
            except EdgetuneError as exc:
                _fail(exc)

        return typer_app.command(*args, **kwargs)(run)

    return register


@_command(app)
def build(
    recipes: Annotated[Optional[list[Path]], typer.Argument(
        metavar="RECIPE",
        help="The recipe YAML file; left out, the default recipe: ResNet-18 for this machine, into ./build. "
             "Several recipes form a release: every one is checked first, then all are built, with one "
             "release.json and release.html in --release-dir.",
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
    strict: Annotated[bool, typer.Option(
        "--strict", help="Exit 1 when a task's tuning failed (it keeps its best schedule so far; exit 0 without).",
    )] = False,
    sign_key: Annotated[Optional[Path], typer.Option(
        "--sign-key", metavar="KEY",
        help="Sign each artifact's manifest with this Ed25519 private key (PEM or 32 raw bytes; make one with "
             "`edgetune keygen`): writes manifest.sig, checked by `edgetune verify --trust KEY.pub`.")] = None,
    workers: Annotated[Optional[str], typer.Option(
        "--workers", metavar="local:N|ray://HEAD:PORT",
        help="Build each (recipe, target) as a unit of work on N local worker processes (a local Ray when Ray is "
             "installed), or on a Ray cluster. Output and records directories must be shared by every worker.")] = None,
    release_dir: Annotated[Optional[Path], typer.Option(
        "--release-dir", metavar="DIR",
        help="Where a release writes release.json and release.html (default: ./release).")] = None,
) -> None:
    """Tune, compile, package and verify every target of RECIPE (of every RECIPE: a release)."""
    if len(recipes or []) > 1 or workers is not None or release_dir is not None:
        _build_release(recipes or [], target, json_path, rpc_tracker or rpc_key, records_dir, strict, sign_key,
                       workers, release_dir)
    recipe = recipes[0] if recipes else None
    from edgetune.fleet.endpoints import override_connection
    from edgetune.recipe import load_default_recipe, load_recipe

    try:
        if recipe is None:
            out.print("no recipe given: building the default recipe (ResNet-18 for this machine) into ./build",
                      markup=False)
        chosen = load_recipe(recipe) if recipe is not None else load_default_recipe()
        if records_dir is not None and records_dir.exists() and not records_dir.is_dir():
            raise InputError(f"--records-dir {records_dir}: exists and is not a directory; expected a directory")
        loaded = override_connection(chosen, target, rpc_tracker, rpc_key)
        from edgetune.pipeline import build as run_build  # imports TVM (seconds): only for a valid recipe

        with _ProgressView(out) as progress:
            result = run_build(loaded, target, progress, records_dir, sign_key, started=COMMAND_STARTED)
    except KeyboardInterrupt:
        err.print("interrupted: every committed measurement is kept; run the same command again to resume")
        raise typer.Exit(130) from None
    _print_summary(result)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    tuning_failed = any(t.tuning_failed for t in result.targets.values())
    raise typer.Exit(0 if result.ok and not (strict and tuning_failed) else 1)


def _keep_torch_out_unless_needed(recipes: list[Path | None]) -> None:
    """Only a torch.export model uses PyTorch, which TVM imports whenever it can (200 MB, 2 s of every command
    that imports TVM: `targets` took 5.0 s with it). Decided for every command from the recipe files it names
    (None: the default recipe, or none), before they are checked (checking a recipe imports TVM); a file that
    cannot be read is left to the check. Only the `edgetune` command's own process refuses it: a caller of this
    module may want it."""
    if not _RUNS_AS_COMMAND:
        return
    for path in recipes:
        if path is None:  # the default recipe: a zoo model
            continue
        try:
            data = read_yaml(path).data
        except InputError:
            return
        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or "exported_program" in model:
            return
    keep_torch_out()


def _build_release(recipes: list[Path], target: list[str] | None, json_path: Path | None, rpc: str | None,
                   records_dir: Path | None, strict: bool, sign_key: Path | None, workers: str | None,
                   release_dir: Path | None) -> None:
    """Several recipes, or any with --workers: check them all, build them all, one summary and exit code."""
    from edgetune.release import DEFAULT_RELEASE_DIR, load_release, run_release, write_release
    from edgetune.workers import parse_workers

    release_dir = release_dir if release_dir is not None else DEFAULT_RELEASE_DIR
    try:
        if rpc is not None:
            raise InputError("--rpc-tracker/--rpc-key set one target's connection: build a single recipe for that")
        if records_dir is not None and records_dir.exists() and not records_dir.is_dir():
            raise InputError(f"--records-dir {records_dir}: exists and is not a directory; expected a directory")
        spec = parse_workers(workers) if workers is not None else None
        items = load_release(recipes, target, release_dir, sign_key)
        out.print(f"release: {sum(len(i.only or i.recipe.fleet) for i in items)} targets of {len(items)} recipes, "
                  f"workers: {spec.text if spec else 'serial, in this process'}", markup=False, soft_wrap=True)
        with _ProgressView(out) as progress:
            release = run_release(items, spec, records_dir, sign_key, progress, _print_unit)
        files = write_release(release, release_dir, strict)
    except KeyboardInterrupt:
        err.print("interrupted: every committed measurement is kept; run the same command again to resume")
        raise typer.Exit(130) from None
    for item in release.recipes:
        if item.result is not None:
            _print_summary(item.result)
        if item.error:
            err.print(f"[bold red]error:[/] {escape(item.file)}: {escape(item.error)}", soft_wrap=True)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(release.to_json(strict), indent=2) + "\n")
    out.print(f"release: {release.wall_s:.1f} s; " + ", ".join(str(f) for f in files), markup=False, soft_wrap=True)
    raise typer.Exit(release.exit_code(strict))


def _print_unit(recipe: str, target: str, outcome) -> None:
    state = f"failed: {outcome.error}" if outcome.error else "done"
    retried = f" (run {outcome.attempts} times: its worker was lost)" if outcome.attempts > 1 else ""
    out.print(f"[{recipe}/{target}] {state}{retried}", markup=False, soft_wrap=True)


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
        done = p.tasks_done
        best = f"{p.best_us:.1f} us" if p.best_us is not None else "-"
        detail = f"task {p.index}/{p.total} {p.task}: {p.trials_text}, best {best}"
        if self.progress is None:
            left = p.seconds_left()
            estimate = f", ~{left:.0f} s left" if left is not None else ""
            self.console.print(f"[{event.target}] {detail}, {p.elapsed_s:.0f} s{estimate}", markup=False)
            return
        if event.target not in self.bars:  # a build bounded by its budget alone fills the bar with the budget's time
            self.bars[event.target] = self.progress.add_task(
                escape(f"[{event.target}] tuning"), total=p.budget_s if p.bounded_by_budget else p.total, detail="")
        completed = p.elapsed_s if p.bounded_by_budget else done
        self.progress.update(self.bars[event.target], completed=completed, detail=escape(detail))


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
        for failure in t.tuning_failed:
            out.print(f"{name}: warning: tuning failed for task {failure}; it keeps its best schedule so far",
                      markup=False, soft_wrap=True)
        if t.time_to_beat_reference_s == 0.0:
            out.print(f"{name}: faster than the reference before any tuning in this build, with the records it "
                      "started from (estimated from its kernels' times)", markup=False, soft_wrap=True)
        elif t.time_to_beat_reference_s is not None:
            out.print(f"{name}: faster than the reference after {t.time_to_beat_reference_s:.0f} s of tuning "
                      "(estimated from its kernels' times)", markup=False, soft_wrap=True)
        if t.timings_disturbed:
            out.print(f"{name}: {t.timings_disturbed} of {t.trials_measured} candidates' timings were disturbed by "
                      f"other work on the device; {t.timings_remeasured} near their task's best were measured again "
                      f"({t.timings_still_disturbed} stayed disturbed)", markup=False, soft_wrap=True)
        if t.timings_in_slow_windows:
            out.print(f"{name}: {t.timings_in_slow_windows} candidates were timed while the whole device ran slow (a "
                      f"reference kernel beside them); {t.timings_retimed_quiet} were timed again "
                      f"once it was quiet ({t.timings_still_slow} could not be)", markup=False,
                      soft_wrap=True)
        if t.timings_on_fewer_threads:
            out.print(f"{name}: {t.timings_on_fewer_threads} candidates were timed on fewer threads than the target's "
                      "cores: other programs kept the rest busy", markup=False, soft_wrap=True)
        if t.transfer and t.transfer["used"]:
            transfer = t.transfer
            out.print(f"{name}: transfer from {', '.join(transfer['sources'])}: {transfer['seeds_measured']} sibling "
                      f"schedules re-measured, still the best for {len(transfer['tasks_best_from_sibling'])} of "
                      f"{len(t.tasks)} tasks" + (f"; guard fell back for {', '.join(transfer['guard_fell_back'])}"
                                                 if transfer["guard_fell_back"] else ""), markup=False, soft_wrap=True)


@_command(app)
def validate(recipe: RecipeArg) -> None:
    """Check RECIPE and the device profiles it names; needs no device."""
    from edgetune.recipe import load_recipe

    loaded = load_recipe(recipe)
    out.print(f"{recipe}: ok ({len(loaded.fleet)} targets: {', '.join(t.name for t in loaded.fleet)})", markup=False,
              soft_wrap=True)


@_command(app)
def targets() -> None:
    """List the device profiles edgetune knows."""
    from edgetune.profiles import list_profiles

    profiles = list_profiles()
    table = Table(title="device profiles")
    for column in ("profile", "isa", "device", "peak GFLOPS", "description"):
        table.add_column(column)
    for p in profiles:
        peak = p.hardware.peak_gflops
        table.add_row(p.name, p.isa, p.device, f"{peak:.0f}" if peak else "-", p.description)
    out.print(table)


@_command(app, help="Check every checksum of ARTIFACT (and its signature, with --trust), then run it (here, in a "
                  "child process, or on a device over RPC) and compare with the reference output.\n\n"
                  "Verifying RUNS THE ARTIFACT'S CODE: its model.so is loaded and executed. Verify only artifacts "
                  "from a source you trust, and pass --trust with that source's public key.")
def verify(
    artifact: Annotated[Path, typer.Argument(help="An artifact directory or its .tar.gz.")],
    rpc_tracker: Annotated[Optional[str], typer.Option(
        "--rpc-tracker", metavar="HOST:PORT", help="Run it on a device behind this RPC tracker (with --rpc-key).")] = None,
    rpc_key: Annotated[Optional[str], typer.Option("--rpc-key", metavar="KEY", help="The device's key.")] = None,
    trust: Annotated[Optional[Path], typer.Option(
        "--trust", metavar="PUBKEY",
        help="Ed25519 public key (PEM or 32 raw bytes): refuse the artifact unless its manifest.sig is this key's "
             "signature of its manifest.json. Checked before anything of the artifact is loaded.")] = None,
) -> None:
    from edgetune.fleet.endpoints import RemoteDevice
    from edgetune.package.verify import verify_artifact

    remote = None
    if (rpc_tracker is None) != (rpc_key is None):
        raise InputError("--rpc-tracker and --rpc-key go together")
    if rpc_tracker is not None:
        host, _, port = rpc_tracker.rpartition(":")
        if not host or not port.isdigit():
            raise InputError(f"--rpc-tracker {rpc_tracker}: expected HOST:PORT")
        remote = RemoteDevice(host, int(port), rpc_key, timeout_s=120.0, compiler="")
    trusted_key = None
    if trust is not None:
        from edgetune.package.signing import load_public_key

        trusted_key = load_public_key(trust)
    outcome = verify_artifact(artifact, remote, trusted_key)
    for line in outcome.problems:
        err.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)
    if outcome.output is not None:
        out.print(f"output vs reference: max abs difference {outcome.output.max_abs_error:.3g}: "
                  f"{'OK' if outcome.output.matches else 'MISMATCH'}")
    if outcome.ok and trust is not None:
        out.print(f"signature: OK ({trust})", markup=False, soft_wrap=True)
    raise typer.Exit(0 if outcome.ok else 1)


@_command(app)
def keygen(
    private_key: Annotated[Path, typer.Argument(help="Where to write the new private key (PEM, mode 600).",
                                                show_default=False)],
) -> None:
    """Make an Ed25519 key pair for `build --sign-key` (PRIVATE_KEY) and `verify --trust` (PRIVATE_KEY.pub)."""
    from edgetune.package.signing import generate_key_pair

    public = generate_key_pair(private_key)
    out.print(f"private key: {private_key}\npublic key: {public}", markup=False, soft_wrap=True)


@_command(app)
def report(
    build_dir: Annotated[Path, typer.Argument(help="A build directory: <output>/<recipe>/.", show_default=False)],
) -> None:
    """Rebuild BUILD_DIR/report.html from the stored summary, manifests and tuning logs."""
    from edgetune.report import render_report

    path = render_report(build_dir)
    out.print(str(path), markup=False, soft_wrap=True)


fleet_app = typer.Typer(no_args_is_help=True, help="Start, inspect and stop what RECIPE's targets are measured on.")
app.add_typer(fleet_app, name="fleet")


def _report(who: str, what: str) -> None:
    out.print(f"[{who}] {what}", markup=False, soft_wrap=True)


def _fleet_recipe(recipe: Path):
    from edgetune.recipe import load_recipe

    return load_recipe(recipe)


def _fleet_done(problems: list[str]) -> None:
    for problem in problems:
        for line in problem.splitlines():
            err.print(f"[bold red]error:[/] {escape(line)}", markup=True, soft_wrap=True)
    raise typer.Exit(1 if problems else 0)


FleetRecipeArg = Annotated[Optional[Path], typer.Argument(
    help="The recipe YAML file (left out: the emulated boards of --emulate).", show_default=False)]
EmulateOption = Annotated[Optional[list[str]], typer.Option(
    "--emulate", metavar="PROFILE",
    help="Start an emulated aarch64 board for this device profile (repeatable); its key is the profile's name.")]
TrackerPortOption = Annotated[int, typer.Option(
    "--tracker-port", min=1, max=65535, help="Port of the local tracker the emulated boards register with.")]
StateDirOption = Annotated[Optional[Path], typer.Option(
    "--state-dir", metavar="DIR", help="Pid files and logs of the emulated boards (default: $EDGETUNE_CACHE/fleet).")]


@_command(fleet_app, "up")
def fleet_up(recipe: FleetRecipeArg = None, emulate: EmulateOption = None, tracker_port: TrackerPortOption = 9190,
             state_dir: StateDirOption = None) -> None:
    """Start the recipe's tracker and each ssh target's RPC server, or (--emulate) emulated aarch64 boards."""
    if emulate:
        from edgetune.fleet import emulated

        if recipe is not None:
            _fail(InputError("fleet up: give a RECIPE or --emulate PROFILE, not both"))
        _fleet_done(emulated.up(emulate, tracker_port, emulated.state_dir(state_dir), _report))
    from edgetune.fleet.provision import up

    _fleet_done(up(_fleet_recipe(_required_recipe(recipe)), _report))


def _required_recipe(recipe: Path | None) -> Path:
    if recipe is None:
        _fail(InputError("fleet: give a RECIPE (or, for emulated boards, leave it out and use --emulate)"))
    return recipe


@_command(fleet_app, "down")
def fleet_down(recipe: FleetRecipeArg = None, state_dir: StateDirOption = None) -> None:
    """Stop what `fleet up` started for RECIPE (without one: the emulated boards), by pid files, and nothing else."""
    if recipe is None:
        from edgetune.fleet import emulated

        _fleet_done(emulated.down(emulated.state_dir(state_dir), _report))
    from edgetune.fleet.provision import down

    _fleet_done(down(_fleet_recipe(recipe), _report))


@_command(fleet_app, "status")
def fleet_status(recipe: FleetRecipeArg = None, state_dir: StateDirOption = None) -> None:
    """Servers per key on each tracker, and each device's health; exit 1 when a target has no server.

    Without RECIPE: the emulated boards `fleet up --emulate` started (key, profile, arch, pid, servers).
    """
    from edgetune.fleet.status import fleet_status as gather
    from edgetune.fleet.tracker import TrackerSummary

    if recipe is None:
        _emulated_status(state_dir)
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


def _emulated_status(state_dir: Path | None) -> None:
    """The emulated boards' table; exit 1 when none runs or one is not registered."""
    from edgetune.errors import BuildError
    from edgetune.fleet import emulated, tracker

    boards = emulated.boards(emulated.state_dir(state_dir))
    table = Table(title="emulated boards")
    for column in ("key", "profile", "arch", "emulated", "tracker", "pid", "servers"):
        table.add_column(column)
    healthy = bool(boards)
    for board in boards:
        try:
            servers = str(tracker.query(board.tracker, timeout_s=2.0).key(board.key).total)
        except BuildError:
            servers = "tracker not answering"
        healthy = healthy and board.pid is not None and servers not in ("0", "tracker not answering")
        cells = (board.key, board.profile, board.arch, f"yes (qemu -cpu {board.qemu_cpu})", board.tracker,
                 str(board.pid) if board.pid else "not running", servers)
        table.add_row(*(escape(cell) for cell in cells))
    if boards:
        out.print(table)
    else:
        out.print("no emulated boards (edgetune fleet up --emulate PROFILE starts one)", markup=False)
    raise typer.Exit(0 if healthy else 1)


records_app = typer.Typer(no_args_is_help=True, help="Carry RECIPE's tuning records between machines.")
app.add_typer(records_app, name="records")


@_command(records_app, "export")
def records_export(
    recipe: RecipeArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The .tar.gz to write.", show_default=False)],
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="Only this target (repeatable).")] = None,
    records_dir: RecordsDirOption = None,
) -> None:
    """Write the record stores of RECIPE's targets into one reproducible archive."""
    from edgetune.pipeline import record_locations
    from edgetune.tuning.database.exchange import export_stores

    locations = record_locations(_fleet_recipe(recipe), target, records_dir)
    present = {loc.directory.name: loc.directory for loc in locations.values() if loc.exists()}
    if not present:
        raise InputError(f"no tuning records yet for {', '.join(locations)} in "
                         f"{next(iter(locations.values())).directory.parent}")
    counts = export_stores(present, output)
    for name, location in locations.items():
        store = location.directory.name
        line = f"{name}: {counts[store]} records ({store})" if store in counts else f"{name}: no records yet"
        out.print(line, markup=False)
    out.print(str(output), markup=False, soft_wrap=True)


@_command(records_app, "import")
def records_import(
    recipe: RecipeArg,
    archive: Annotated[Path, typer.Argument(help="A .tar.gz from `edgetune records export`.", show_default=False)],
    records_dir: RecordsDirOption = None,
) -> None:
    """Merge ARCHIVE's record stores into RECIPE's records directory; nothing local is removed."""
    from edgetune.pipeline import record_locations
    from edgetune.tuning.database.exchange import import_stores

    locations = record_locations(_fleet_recipe(recipe), None, records_dir)
    root = next(iter(locations.values())).directory.parent
    owners = {loc.directory.name: name for name, loc in locations.items()}
    imported = import_stores(archive, root)
    for store in imported:
        owner = owners.get(store.name)
        who = f"{owner}" if owner else f"{store.name} (no target of this recipe has this profile and TVM target; kept)"
        out.print(f"{who}: {store.added} records added, {store.present} already here", markup=False, soft_wrap=True)


@_command(records_app, "check")
def records_check(recipe: RecipeArg, records_dir: RecordsDirOption = None) -> None:
    """List the damaged lines (file:line) of RECIPE's record stores; exit 1 if any, 0 if all are intact."""
    from edgetune.tuning.database.store import scan_store

    damaged = []
    for name, location in _record_locations(recipe, records_dir).items():
        if not location.exists():
            out.print(f"{name}: no records yet", markup=False)
            continue
        found = scan_store(location.directory, deep=True).damaged
        damaged.extend(found)
        out.print(f"{name}: {location.directory}: " + (f"{len(found)} damaged lines" if found else "intact"),
                  markup=False, soft_wrap=True)
    for line in damaged:
        err.print(f"[bold red]damaged:[/] {escape(str(line))}", soft_wrap=True)
    if damaged:
        err.print("`edgetune records repair RECIPE` rewrites the stores without them, keeping backups",
                  markup=False)
    raise typer.Exit(1 if damaged else 0)


@_command(records_app, "repair")
def records_repair(recipe: RecipeArg, records_dir: RecordsDirOption = None) -> None:
    """Rewrite each damaged store of RECIPE without its damaged lines, keeping each original file as a backup."""
    from edgetune.tuning.database.store import repair_store

    for name, location in _record_locations(recipe, records_dir).items():
        if not location.exists():
            continue
        repaired = repair_store(location.directory)
        if not repaired.damaged:
            out.print(f"{name}: {location.directory}: intact, left as it is", markup=False, soft_wrap=True)
            continue
        for line in repaired.damaged:
            out.print(f"{name}: dropped {line}", markup=False, soft_wrap=True)
        out.print(f"{name}: originals kept as {', '.join(str(b) for b in repaired.backups)}", markup=False,
                  soft_wrap=True)


def _record_locations(recipe: Path, records_dir: Path | None) -> dict:
    from edgetune.pipeline import record_locations

    return record_locations(_fleet_recipe(recipe), None, records_dir)
def main() -> None:
    global _RUNS_AS_COMMAND
    _RUNS_AS_COMMAND = True
    sys.stdout.reconfigure(line_buffering=True)  # progress must reach a CI log as it happens
    sys.exit(app())
