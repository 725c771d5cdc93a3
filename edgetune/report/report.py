"""report.html: what a build did, at a glance, for the people who read it and for CI.

Rendered only from the files a build leaves behind (summary.json, each target's manifest.json and
its tuning log), so `edgetune report` can rebuild it at any time without re-running anything. The
page is one file, CSS inline and figures as base64 PNG data URIs, with no timestamps: the same
inputs give the same bytes, and the page can be archived or attached to a CI run as it is.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import jinja2
from matplotlib import style, ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from pydantic import ValidationError

from edgetune.errors import InputError
from edgetune.package.artifact import MANIFEST_NAME
from edgetune.package.manifest import Manifest, parse_manifest
from edgetune.report.summary import SUMMARY_NAME, TargetResult

REPORT_NAME = "report.html"
_DPI = 100
_LINESTYLES = ("-", "--", ":", "-.")  # after the 10 colours of the cycle, so 40 tasks stay distinct

_TASK_DEFAULTS: dict[str, Any] = {
    "weight": 1, "trials": 0, "trials_measured_now": 0, "tuning_s": None, "best_us": None, "gflops": None,
    "skipped_for_budget": False,
    "space_exhausted": False, "candidates": None, "search_fallback": None, "tuning_failed": None,
}

Curve = list[tuple[float, float]]


def _ms(value: float | None) -> str:
    return f"{value:.3f} ms" if value is not None else "-"


def _us(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def _speedup(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def _seconds(value: float | None) -> str:
    return f"{value:.0f} s" if value is not None else "-"


_TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("edgetune.report", "templates"),
    autoescape=True,  # error messages and paths go into the page as text
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)
_TEMPLATES.filters.update(ms=_ms, us=_us, speedup=_speedup, seconds=_seconds)


def render_report(build_dir: Path) -> Path:
    """Write `build_dir/report.html` from the build's stored files and return its path."""
    summary = _read_json(build_dir / SUMMARY_NAME, "build summary")
    raw_targets = summary.get("targets")
    if not isinstance(summary.get("recipe"), str) or not isinstance(raw_targets, dict):
        raise InputError(f"{build_dir / SUMMARY_NAME}: not an edgetune build summary (no recipe or targets)")
    targets = [_target_view(build_dir, name, _target_result(build_dir, name, raw))
               for name, raw in raw_targets.items()]
    html = _TEMPLATES.get_template("report.html.j2").render(
        recipe=summary["recipe"],
        ok=bool(summary.get("ok")),
        targets=targets,
        failed=[t for t in targets if t["result"].error],
    )
    path = build_dir / REPORT_NAME
    path.write_text(html)
    return path


def tuning_curves(log_path: Path) -> dict[str, Curve]:
    """Per task, (cumulative tuning wall time in s, best latency so far in us), from a tuning log.

    A resumed build starts `elapsed_s` again from 0, so a decrease opens a new session, shifted by
    where the previous session ended: the time axis adds up the tuning time of every build.
    A missing log (nothing was measured) gives no curves.
    """
    curves: dict[str, Curve] = {}
    if not log_path.is_file():
        return curves
    offset = previous = 0.0
    for number, line in enumerate(log_path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            task, elapsed, best = str(entry["task"]), float(entry["elapsed_s"]), entry["best_us"]
            best = float(best) if best is not None else None
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"{log_path}:{number}: not a tuning log entry ({exc!r})") from None
        if elapsed < previous:
            offset += previous
        previous = elapsed
        if best is not None:  # no valid candidate yet: nothing to draw
            curves.setdefault(task, []).append((offset + elapsed, best))
    return curves


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no {what} here (is this a build directory, <output>/<recipe>/?)") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: cannot read the {what}: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a {what} (a JSON object was expected)")
    return data


def _target_result(build_dir: Path, name: str, raw: Any) -> TargetResult:
    """A target's entry of the summary, typed; InputError naming each field that is not what a build writes."""
    where = f"{build_dir / SUMMARY_NAME}: targets.{name}"
    if not isinstance(raw, dict):
        raise InputError(f"{where}: not a target result")
    try:
        return TargetResult.model_validate(raw)
    except ValidationError as exc:
        raise InputError([f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]) from None


def _target_view(build_dir: Path, name: str, result: TargetResult) -> dict[str, Any]:
    """Everything the template shows for one target, with the numbers derived here rather than in Jinja."""
    manifest_path = build_dir / name / MANIFEST_NAME
    # The target's record store (summaries before per-device stores: work/<target>/records).
    log_path = build_dir / (result.records or f"work/{name}/records") / "tuning_log.jsonl"
    view: dict[str, Any] = {
        "name": name, "result": result, "tasks": _task_rows(result.tasks), "speedup_untuned": None,
        "speedup_reference": None, "manifest_path": str(manifest_path), "manifest": None,
        "latency_chart": None, "curve_chart": None, "model_curve_chart": None, "log_path": str(log_path),
    }
    if result.error:  # a failed target: its error, and nothing that could be mistaken for its numbers
        return view
    tuned = result.latency_ms
    if tuned:
        view["speedup_untuned"] = _ratio(result.untuned_latency_ms, tuned)
        view["speedup_reference"] = _ratio(result.reference_latency_ms, tuned)
        view["latency_chart"] = _latency_chart(tuned, result.untuned_latency_ms, result.reference_latency_ms)
    if result.tuning_curve:
        view["model_curve_chart"] = _model_curve_chart(result.tuning_curve, result.reference_latency_ms)
    if manifest_path.is_file():
        manifest = parse_manifest(_read_json(manifest_path, "artifact manifest"), manifest_path)
        view["manifest"] = _manifest_facts(manifest, result)
    curves = tuning_curves(log_path)
    if curves:
        order = [t["name"] for t in result.tasks if t["name"] in curves]
        view["curve_chart"] = _curve_chart([(task, curves[task]) for task in order + sorted(curves.keys() - order)])
    return view


def _ratio(slower: float | None, tuned: float) -> float | None:
    return slower / tuned if slower is not None else None


def _task_rows(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary's tasks with each one's share of the tuned tasks' time: weight * best_us over the sum."""
    tasks = [{**_TASK_DEFAULTS, **t} for t in tasks]
    costs = [t["weight"] * t["best_us"] if t["best_us"] is not None else None for t in tasks]
    total = sum(c for c in costs if c is not None)
    return [{**t, "share": cost / total if cost is not None and total else None} for t, cost in zip(tasks, costs)]


def _manifest_facts(manifest: Manifest, result: TargetResult) -> dict[str, Any]:
    """The manifest as labelled rows: a field an older edgetune did not write shows as None."""
    target, model, tuning, verification = manifest.target, manifest.model, manifest.tuning, manifest.verification
    inputs = ", ".join(f"{i.name} {i.dtype}{list(i.shape or [])}" for i in model.inputs)
    tasks_total = tuning.tasks_total
    return {
        "device": [
            ("profile", target.profile),
            ("ISA", target.isa),
            ("TVM device", target.device),
            ("TVM target", json.dumps(target.tvm_target, sort_keys=True)),
            ("measured on", manifest.measured_on),
        ],
        "contributions": [_transfer_line(result.transfer, len(result.tasks)),
                          _search_line(tuning.search, result),
                          _selection_line(result.selection, result.kept_for_selection_s,
                                          result.selection_skipped)],
        "tuning": [
            ("this build measured", f"{result.trials_measured} candidates"
                                    + (f" in {result.tuning_s:.0f} s" if result.tuning_s else "")),
            ("timings disturbed", f"{result.timings_disturbed}; near the best, measured again: "
                                  f"{result.timings_remeasured}, of which stayed disturbed: "
                                  f"{result.timings_still_disturbed}"),
            ("timed on fewer threads", f"{result.timings_on_fewer_threads} (other programs held cores)"),
            ("timed in slow windows", (f"{result.timings_in_slow_windows}; timed again once quiet: "
                                       f"{result.timings_retimed_quiet}; could not be: {result.timings_still_slow}")),
            ("trials per task", tuning.trials_per_task),
            ("time budget", f"{tuning.time_budget_min} min" if tuning.time_budget_min else "none"),
            ("seed", tuning.seed),
            ("tasks tuned", f"{len(result.tasks)} of {tasks_total}"),
        ],
        "untuned_tasks": tasks_total - len(result.tasks) if tasks_total is not None else 0,
        "verification": [
            ("reference", verification.reference),
            ("max abs error", f"{verification.max_abs_error:.3g}" if verification.max_abs_error is not None else None),
            ("tolerance", f"rtol {verification.rtol}, atol {verification.atol}"),
            ("matches", "yes" if verification.matches else "no"),
        ],
        "model": [
            ("model", model.name),
            ("model sha256", model.sha256),
            ("inputs", inputs),
            ("recipe sha256", manifest.recipe.sha256),
            ("build inputs sha256", manifest.build_inputs_sha256),
        ],
        "versions": [("edgetune", manifest.edgetune_version), *sorted(manifest.versions.items())],
        "files": sorted(manifest.files.items()),
    }


def _transfer_line(transfer: dict[str, Any] | None, tasks: int) -> str:
    """What sibling devices' records contributed to this target, from the build summary."""
    if transfer is None:
        return "transfer: none (no sibling device in this fleet: same ISA family and device kind, or transfer_from)"
    sources = ", ".join(transfer["sources"])
    if not transfer["used"]:
        return f"transfer from {sources}: not used ({transfer['why_not']})"
    line = (f"transfer from {sources} ({transfer['mode']}): {transfer['sibling_records']} sibling records trained "
            f"the prior; {transfer['seeds_measured']} of their best schedules re-measured here; a sibling's schedule "
            f"is still the best for {len(transfer['tasks_best_from_sibling'])} of {tasks} tasks")
    fell_back = transfer["guard_fell_back"]
    if fell_back:
        return line + f"; the guard set the siblings' model aside for {', '.join(fell_back)}"
    return line + "; the guard kept the siblings' model for every task"


def _selection_line(selection: dict[str, Any] | None, kept_s: float, skipped: str | None) -> str:
    """What comparing schedules inside the model changed, from the build summary."""
    if skipped:
        return f"schedules: the tuner's best for every kernel (not compared inside the model: {skipped})"
    if selection is None:
        return "schedules: the tuner's best for every kernel (not compared inside the model on this target)"
    if not selection["models_compiled"]:
        return "schedules: the tuner's best for every kernel (no kernel had a tuned schedule to compare)"
    changed, kept_default = selection["kernels_changed"], selection.get("kernels_default", [])
    budget = ""
    if kept_s:
        budget = f"; the tuning budget kept {kept_s:.0f} s for it"
        if selection.get("stopped_by_budget"):
            budget += f" and its end stopped it after {selection['models_compiled']} models"
    return (f"schedules: each kernel's {selection['candidates']} best and its default compared inside the model "
            f"({selection['models_compiled']} models compiled, {selection['seconds']:.0f} s{budget}); another "
            f"than the tuner's best ran faster there for {len(changed)} kernels, and the default schedule beat "
            f"every tuned one for {len(kept_default)}; the kernels took "
            f"{selection['tuner_best_in_model_us']:.0f} us per inference with the tuner's best, "
            f"{selection['in_model_us']:.0f} us with those chosen{_verified(selection.get('verified_ratio'))}"
            f"{_fewer_threads(selection.get('timed_on_threads'), selection.get('cpu_threads'))}")


def _fewer_threads(timed_on: int | None, threads: int | None) -> str:
    """Where other programs held cores while the models were compared: on how many threads they were."""
    if not timed_on or not threads or timed_on >= threads:
        return ""
    return f"; compared on {timed_on} of {threads} threads (other programs kept the rest busy)"


def _verified(ratio: float | None) -> str:
    """What came of timing the chosen schedules' whole model in turns with the tuner's best."""
    if ratio is None:
        return ""
    outcome = "it is packaged" if ratio < 1.0 else "so every kernel keeps the tuner's best"
    return f"; the chosen model, timed whole in turns with the tuner's best, took {ratio:.3f}x its time: {outcome}"


def _search_line(search: str | None, result: TargetResult) -> str:
    """Candidates per stage of draft-then-verify in this build (the stock search has one stage)."""
    counts = [t["candidates"] for t in result.tasks if t.get("candidates")]
    if search != "draft-verify" or not counts:
        return f"search: {search}, candidates measured in this build: {result.trials_measured}"
    total = {stage: sum(c[stage] for c in counts) for stage in ("explored", "drafted", "verified")}
    fallbacks = sum(1 for t in result.tasks if t.get("search_fallback"))
    return (f"search: draft-verify, in this build: {total['explored']:,} candidates scored by the analyzer, "
            f"{total['drafted']:,} drafted, {total['verified']:,} verified by the learned model, "
            f"{result.trials_measured:,} measured"
            + (f"; {fallbacks} of {len(result.tasks)} tasks fell back (see Tasks)" if fallbacks else ""))


def _latency_chart(tuned: float, untuned: float | None, reference: float | None) -> str:
    bars = [(label, value, colour) for label, value, colour in (
        ("TVM tuned", tuned, "#2b8a3e"), ("TVM untuned", untuned, "#868e96"), ("ONNX Runtime", reference, "#1864ab"),
    ) if value is not None]
    with style.context("default"):  # the user's matplotlibrc must not change the page
        figure = Figure(figsize=(6.4, 0.45 * len(bars) + 0.7), dpi=_DPI, layout="constrained")
        axes = figure.add_subplot()
        positions = range(len(bars))
        axes.barh(positions, [b[1] for b in bars], color=[b[2] for b in bars], height=0.6)
        axes.set_yticks(positions, [b[0] for b in bars])
        axes.invert_yaxis()
        axes.set_xlabel("latency (ms), lower is better")
        axes.set_xlim(0, max(b[1] for b in bars) * 1.22)
        for position, (_, value, _) in zip(positions, bars):
            axes.text(value, position, f" {value:.3f}", va="center", fontsize=9)
        axes.spines[["top", "right"]].set_visible(False)
        return _png(figure)


def _model_curve_chart(curve: list[tuple[float, float]], reference: float | None) -> str:
    """The model's latency as tuning went on (estimated between the measured end points), with the reference's."""
    with style.context("default"):
        figure = Figure(figsize=(6.4, 3.0), dpi=_DPI, layout="constrained")
        axes = figure.add_subplot()
        axes.plot([p[0] for p in curve], [p[1] for p in curve], drawstyle="steps-post", marker="o", markersize=4,
                  color="#2b8a3e", label="TVM, tuned (estimated from kernel times)")
        if reference is not None:
            axes.axhline(reference, color="#1864ab", linestyle="--", label="ONNX Runtime")
        axes.set_xlim(left=0)
        axes.set_ylim(bottom=0)
        axes.set_xlabel("tuning wall time (s)")
        axes.set_ylabel("model latency (ms)")
        axes.grid(True, alpha=0.3)
        axes.spines[["top", "right"]].set_visible(False)
        axes.legend(fontsize=8, frameon=False)
        return _png(figure)


def _curve_chart(curves: list[tuple[str, Curve]]) -> str:
    with style.context("default"):
        figure = Figure(figsize=(9.6, 4.2), dpi=_DPI, layout="constrained")
        axes = figure.add_subplot()
        for index, (task, points) in enumerate(curves):
            axes.plot([p[0] for p in points], [p[1] for p in points], drawstyle="steps-post", marker="o",
                      markersize=5, linewidth=1.5, linestyle=_LINESTYLES[index // 10 % len(_LINESTYLES)],
                      color=f"C{index % 10}", label=task)
        axes.set_yscale("log")
        # Plain numbers ("40", not "4 x 10^1"): a tuning curve rarely spans a decade.
        axes.yaxis.set_major_formatter(ticker.LogFormatter())
        axes.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 1)))
        axes.set_xlim(left=0)
        axes.set_xlabel("cumulative tuning wall time (s)")
        axes.set_ylabel("best latency so far (µs, log)")
        axes.grid(True, which="both", alpha=0.3)
        axes.spines[["top", "right"]].set_visible(False)
        figure.legend(loc="outside right upper", fontsize=8, ncols=1 if len(curves) <= 16 else 2, frameon=False)
        return _png(figure)


def _png(figure: Figure) -> str:
    """The figure as a data URI; no Software/date metadata, so the same figure gives the same bytes."""
    buffer = io.BytesIO()
    FigureCanvasAgg(figure).print_png(buffer, metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
