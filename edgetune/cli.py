"""The `edgetune` command: parse arguments, call the pipeline, render results. No logic of its own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from edgetune.errors import EdgetuneError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Tune a model for a fleet of edge devices with Apache TVM.")
out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False)

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]


def _fail(exc: EdgetuneError) -> None:
    for line in str(exc).splitlines():
        err.print(f"[bold red]error:[/] {line}", markup=True, soft_wrap=True)
    raise typer.Exit(exc.exit_code)


@app.command()
def build(
    recipe: RecipeArg,
    target: Annotated[Optional[list[str]], typer.Option("--target", "-t", help="Build only this target (repeatable).")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the machine-readable summary here.")] = None,
) -> None:
    """Tune, compile, package and verify every target of RECIPE."""
    from edgetune.pipeline import build as run_build
    from edgetune.recipe import load_recipe

    try:
        loaded = load_recipe(recipe)
        result = run_build(loaded, target, _print_event)
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


def _print_event(event) -> None:
    if event.task is None:
        out.print(f"[{event.target}] {event.message}", markup=False)
        return
    p = event.task
    best = f"{p.best_us:.1f} us" if p.best_us is not None else "-"
    out.print(f"[{event.target}] task {p.index}/{p.total} {p.task}: {p.trials_done}/{p.trials_planned} trials, "
              f"best {best}, {p.elapsed_s:.0f} s", markup=False)


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


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
            f"{t.untuned_latency_ms / t.latency_ms:.1f}x", f"{t.reference_latency_ms / t.latency_ms:.2f}x",
            "[green]yes[/]" if t.verified else "[red]no[/]", f"{t.trials_total} ({t.trials_measured})",
        )
    out.print(table)
    for name, t in result.targets.items():
        line = f"{name}: failed: {t.error}" if t.error else f"{name}: {t.artifact}" + (" (reused)" if t.reused else "")
        out.print(line, markup=False, soft_wrap=True)


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
def verify(artifact: Annotated[Path, typer.Argument(help="An artifact directory or its .tar.gz.")]) -> None:
    """Check every checksum of ARTIFACT, then run it here and compare with the reference output."""
    from edgetune.package.verify import verify_artifact

    try:
        outcome = verify_artifact(artifact)
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


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # progress must reach a CI log as it happens
    sys.exit(app())
