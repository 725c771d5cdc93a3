"""report.html: rendered from a real tiny build's files, deterministic, self-contained, and readable in a browser."""

from __future__ import annotations

import json
import shutil
import subprocess
from html import unescape
from pathlib import Path

import numpy as np
import pytest
from conftest import run_edgetune as edgetune

from edgetune.errors import InputError
from edgetune.report import render_report, tuning_curves

TAB_ORANGE = (255, 127, 14)  # matplotlib's C1: only the second task's tuning curve is drawn in it




@pytest.fixture
def build_dir(tiny_build, tmp_path) -> Path:
    """A copy elsewhere: the report must not depend on the paths recorded at build time."""
    return Path(shutil.copytree(tiny_build[0] / "out" / "tiny", tmp_path / "tiny"))


@pytest.mark.slow
def test_report_holds_the_summary_figures_and_embeds_its_images(build_dir) -> None:
    summary = json.loads((build_dir / "summary.json").read_text())
    host = summary["targets"]["host"]
    html = render_report(build_dir).read_text()

    for key in ("latency_ms", "untuned_latency_ms", "reference_latency_ms"):
        assert f"{host[key]:.3f} ms" in html
    assert f"{host['untuned_latency_ms'] / host['latency_ms']:.2f}x" in html
    for task in host["tasks"]:
        assert task["name"] in html
        assert f"{task['trials']} ({task['trials_measured_now']})" in html
        assert f"{task['best_us']:.1f}" in html
        assert task["tuning_s"] >= 0 and f"<td class=\"num\">{task['tuning_s']:.1f}</td>" in html
    assert sum(task["tuning_s"] for task in host["tasks"]) <= host["tuning_s"] + 0.5  # the rounds are within the tuning
    assert f"{host['trials_total']} ({host['trials_measured']})" in html
    assert "transfer: none (no sibling device in this fleet" in html
    assert "search: draft-verify, in this build: " in html and f"{host['trials_measured']:,} measured" in html
    manifest = json.loads((build_dir / "host" / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        assert name in html and digest in html
    assert manifest["versions"]["tvm"] in html and manifest["measured_on"] in html
    assert html.count("data:image/png;base64,") == 3  # latency bars, the model's curve, the tasks' curves
    assert "Time to beat ONNX Runtime: " in html
    assert "http://" not in html and "https://" not in html


@pytest.mark.slow
def test_report_says_what_transfer_and_drafting_contributed(build_dir) -> None:
    """A target warm-started by a sibling, tuned with draft-then-verify: the report gives the counts."""
    summary = json.loads((build_dir / "summary.json").read_text())
    host = summary["targets"]["host"]
    host["transfer"] = {"sources": ["big-board"], "used": True, "mode": "momentum", "sibling_records": 37,
                        "seeds_measured": 8, "tasks_best_from_sibling": [host["tasks"][0]["name"]],
                        "guard_fell_back": [host["tasks"][1]["name"]]}
    for task in host["tasks"]:
        task["candidates"] = {"explored": 5000, "drafted": 512, "verified": 160}
    (build_dir / "summary.json").write_text(json.dumps(summary))
    manifest_path = build_dir / "host" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tuning"]["search"] = "draft-verify"
    manifest_path.write_text(json.dumps(manifest))
    text = unescape(render_report(build_dir).read_text())
    tasks = len(host["tasks"])
    assert (f"transfer from big-board (momentum): 37 sibling records trained the prior; 8 of their best schedules "
            f"re-measured here; a sibling's schedule is still the best for 1 of {tasks} tasks") in text
    assert f"the guard set the siblings' model aside for {host['tasks'][1]['name']}" in text
    assert (f"{5000 * tasks:,} candidates scored by the analyzer, {512 * tasks:,} drafted, {160 * tasks:,} verified by "
            f"the learned model, {host['trials_measured']:,} measured") in text


def test_report_says_why_schedules_were_not_compared_inside_the_model(build_dir) -> None:
    summary = json.loads((build_dir / "summary.json").read_text())
    host = summary["targets"]["host"]
    host["selection"], host["selection_skipped"] = None, "two compiles and runs of the model do not fit its share"
    (build_dir / "summary.json").write_text(json.dumps(summary))
    text = unescape(render_report(build_dir).read_text())
    assert ("the tuner's best for every kernel (not compared inside the model: two compiles and runs of the model "
            "do not fit its share") in text


@pytest.mark.slow
def test_rendering_twice_gives_the_same_bytes(build_dir) -> None:
    first = render_report(build_dir).read_bytes()
    assert render_report(build_dir).read_bytes() == first


@pytest.mark.slow
def test_cli_rebuilds_the_same_report(build_dir) -> None:
    expected = render_report(build_dir).read_bytes()
    (build_dir / "report.html").unlink()
    run = edgetune("report", str(build_dir))
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(build_dir / "report.html") in run.stdout
    assert (build_dir / "report.html").read_bytes() == expected  # another process, the same bytes


@pytest.mark.slow
def test_a_browser_shows_the_plots(build_dir, tmp_path) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.fail("chromium is not installed: `apt-get update && apt-get install -y chromium` (Debian) to run this test")
    report = render_report(build_dir)
    screenshot = tmp_path / "report.png"
    run = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={screenshot}",
         "--window-size=1280,2000", report.as_uri()],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert screenshot.is_file(), run.stderr
    from matplotlib import pyplot as plt

    pixels = (plt.imread(screenshot)[..., :3] * 255).round().astype(int)
    assert pixels.shape[:2] == (2000, 1280)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 300  # anti-aliased figures, not just text
    orange = np.abs(pixels - np.array(TAB_ORANGE)).max(axis=-1) <= 20
    assert orange.sum() > 50, "the tuning curve of the second task is not on the page"


def test_a_directory_without_summary_is_an_input_error(tmp_path) -> None:
    with pytest.raises(InputError, match=str(tmp_path / "summary.json")):
        render_report(tmp_path)
    run = edgetune("report", str(tmp_path))
    assert run.returncode == 2
    assert str(tmp_path / "summary.json") in run.stderr


def test_an_invalid_summary_is_an_input_error(tmp_path) -> None:
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(InputError, match="summary.json: cannot read"):
        render_report(tmp_path)
    (tmp_path / "summary.json").write_text('{"recipe": "x"}')
    with pytest.raises(InputError, match="not an edgetune build summary"):
        render_report(tmp_path)


def test_a_failed_target_shows_its_error_and_no_plots(tmp_path) -> None:
    error = "target 'pi': tuning through an RPC tracker is not available <yet>"
    failed = {"name": "pi", "artifact": None, "latency_ms": None, "untuned_latency_ms": None,
              "reference_latency_ms": None, "verified": False, "trials_measured": 0, "trials_total": 0,
              "tasks": [], "reused": False, "error": error, "wall_s": 0.5}
    (tmp_path / "summary.json").write_text(json.dumps({"recipe": "fleet", "ok": False, "targets": {"pi": failed}}))
    html = render_report(tmp_path).read_text()
    assert "not available &lt;yet&gt;" in html
    assert "FAILED" in html and "data:image/png" not in html


def test_tuning_curves_add_up_the_wall_time_of_resumed_builds(tmp_path) -> None:
    entries = [
        {"task": "a", "best_us": None, "elapsed_s": 1.0},
        {"task": "a", "best_us": 50.0, "elapsed_s": 2.0},
        {"task": "b", "best_us": 30.0, "elapsed_s": 4.0},
        {"task": "a", "best_us": 40.0, "elapsed_s": 1.5},  # the next build: its clock starts again
        {"task": "b", "best_us": 20.0, "elapsed_s": 3.0},
        {"task": "b", "best_us": 10.0, "elapsed_s": 0.5},  # and the one after
    ]
    log = tmp_path / "tuning_log.jsonl"
    log.write_text("".join(json.dumps({"measured": 1, "trials": 1, **e}) + "\n" for e in entries))
    assert tuning_curves(log) == {"a": [(2.0, 50.0), (5.5, 40.0)], "b": [(4.0, 30.0), (7.0, 20.0), (7.5, 10.0)]}
    assert tuning_curves(tmp_path / "missing.jsonl") == {}
    log.write_text('{"task": "a"}\n')
    with pytest.raises(InputError, match="tuning_log.jsonl:1"):
        tuning_curves(log)
