"""The typed manifest and summary: written back byte for byte, and a hostile manifest refused with a message
naming the field, before anything of the artifact is used. Fast: no TVM, no build."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from test_artifact import make_artifact

from edgetune.errors import InputError
from edgetune.package.artifact import MANIFEST_NAME, write_manifest
from edgetune.package.manifest import MAX_ENTRIES, MAX_TEXT, Manifest, manifest_text, parse_manifest
from edgetune.package.verify import load_manifest, verify_artifact
from edgetune.report.summary import BuildResult, TargetResult

SOURCE = Path("host/manifest.json")
DIGEST = "0123456789abcdef" * 4

BUILT: dict[str, Any] = {
    "edgetune_version": "0.1.0",
    "build_inputs_sha256": DIGEST,
    "recipe": {"name": "tiny", "sha256": DIGEST},
    "model": {"name": "tiny_cnn \u00e9\u4e2d", "sha256": DIGEST,
              "inputs": [{"name": "data", "shape": [1, 3, 16, 16], "dtype": "float32"}], "outputs": ["logits"]},
    "target": {"name": "host", "profile": "host", "device": "cpu", "isa": "x86_64", "arch": "x86_64",
               "tvm_target": {"kind": "llvm", "mcpu": "znver4", "mattr": ["-avx512vnni"], "num-cores": 2},
               "tvm_host": None},
    "versions": {"tvm": "0.27.0", "llvm": "17", "onnxruntime": "1.20.1", "numpy": "2.1.3", "python": "3.11.9"},
    "toolchain": {"cc": "gcc", "cc_version": "gcc 12.2.0", "cxx": "g++", "nvcc": None},
    "cuda_kernels": None,
    "runtime_bundled": False,
    "tuning": {"search": "evolutionary", "trials_per_task": 2, "time_budget_min": 12.0, "seed": 1,
               "winograd": True, "tasks_total": 4, "trials_total": 4,
               "tasks": [{"name": "fused_conv2d", "weight": 1, "flops": 114688.0, "best_us": 3.995900000000001,
                          "candidates": None, "skipped_for_budget": False, "in_model_rank": 0}]},
    "latency_ms": {"tuned": 0.021057042730122176, "untuned": 0.02980213017003677, "onnxruntime": 1e-05},
    "measured_on": "this build machine (x86_64, 2 cores)",
    "verification": {"reference": "onnxruntime", "rtol": 0.0001, "atol": 1e-05, "matches": True,
                     "max_abs_error": 2.384185791015625e-07, "methods": ["TVM's Python runtime, this machine"],
                     "not_run": None},
    "files": {"README.md": DIGEST, "deploy/deploy.cc": DIGEST, "model.so": DIGEST},
}
"""A manifest as the build writes it: every field, floats of every form, a non-ASCII name."""

MINIMAL: dict[str, Any] = {
    "target": {"device": "cpu", "arch": "x86_64"}, "model": {"inputs": [{"name": "data"}], "outputs": ["logits"]},
    "verification": {"rtol": 1e-4, "atol": 1}, "files": {"model.so": DIGEST},
}
"""What `verify` needs, and no more: a hand-made manifest."""


def _refused(fields: Any) -> str:
    with pytest.raises(InputError) as caught:
        parse_manifest(fields, SOURCE)
    return str(caught.value)


def _changed(path: str, value: Any, base: dict[str, Any] = BUILT) -> dict[str, Any]:
    """`base` with the field at dotted `path` (list indexes as numbers) set to `value`."""
    fields = copy.deepcopy(base)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    holder = fields
    for step in parents:
        holder = holder[step]
    holder[last] = value
    return fields


@pytest.mark.parametrize("fields", [BUILT, MINIMAL], ids=["built", "minimal"])
def test_a_manifest_is_written_back_byte_for_byte(fields: dict[str, Any]) -> None:
    text = json.dumps(fields, indent=2, sort_keys=True) + "\n"
    manifest = parse_manifest(json.loads(text), SOURCE)
    assert manifest.text() == text == manifest_text(fields)
    assert parse_manifest(json.loads(manifest.text()), SOURCE) == manifest


def test_write_manifest_gives_the_same_bytes_for_the_model_and_its_json(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path)
    write_manifest(directory, {key: value for key, value in BUILT.items() if key != "files"})
    from_json = (directory / MANIFEST_NAME).read_bytes()
    write_manifest(directory, Manifest.model_validate({**BUILT, "files": {}}))
    assert (directory / MANIFEST_NAME).read_bytes() == from_json
    assert sorted(load_manifest(directory).files) == sorted(json.loads(from_json)["files"])


def test_an_absent_field_stays_absent_and_reads_as_none() -> None:
    manifest = parse_manifest(MINIMAL, SOURCE)
    assert manifest.measured_on is None and manifest.tuning.tasks_total is None and manifest.versions == {}
    assert "measured_on" not in manifest.text() and "tuning" not in manifest.text()


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "deploy/../../x", "a\\b", "\\share", "C:x", ""])
def test_a_listed_path_outside_the_artifact_is_refused(name: str) -> None:
    message = _refused(_changed("files", {name: DIGEST}))
    assert f"{SOURCE}: files[{name!r}]: points outside the artifact; expected a relative path inside it" in message


@pytest.mark.parametrize("digest", ["A" * 64, "0" * 63, "0" * 65, "g" * 64, DIGEST + "\n", 64])
def test_a_checksum_that_is_not_64_hex_digits_is_refused(digest: Any) -> None:
    message = _refused(_changed("files", {"model.so": digest}))
    assert f"{SOURCE}: files['model.so']: " in message
    assert ("expected a sha256 (64 hex digits)" if isinstance(digest, str) else "expected a string, found int") in message


@pytest.mark.parametrize(("path", "value", "expected"), [
    ("verification.rtol", "0.1", "verification.rtol: expected a number, found str"),
    ("verification.atol", True, "verification.atol: expected a number, found bool"),
    ("verification.matches", "yes", "verification.matches: expected true or false, found str"),
    ("model.inputs.0", "data", "model.inputs[0]: expected an object, found str"),
    ("model.inputs.0.name", 7, "model.inputs[0].name: expected a string, found int"),
    ("model.inputs.0.shape.1", 3.0, "model.inputs[0].shape[1]: expected an integer, found float"),
    ("model.outputs", ["logits", 5], "model.outputs[1]: expected a string, found int"),
    ("target", [], "target: expected an object, found list"),
    ("target.device", None, "target.device: expected a string, found NoneType"),
    ("tuning.seed", "1", "tuning.seed: expected an integer, found str"),
    ("model.sha256", "not a digest", "model.sha256: expected a sha256 (64 hex digits)"),
    ("files", ["model.so"], "files: expected an object, found list"),
    ("versions.tvm", 27, "versions['tvm']: expected a string, found int"),
    ("target.kernel", "x", "target.kernel: not a field of an edgetune manifest"),
])
def test_a_field_of_the_wrong_type_is_named(path: str, value: Any, expected: str) -> None:
    assert f"{SOURCE}: {expected}" in _refused(_changed(path, value))


def test_huge_lists_and_strings_are_refused() -> None:
    assert "model.outputs: more than 10000 entries" in _refused(_changed("model.outputs", ["y"] * (MAX_ENTRIES + 1)))
    files = {f"f{i}": DIGEST for i in range(MAX_ENTRIES + 1)}
    assert "files: more than 10000 entries" in _refused(_changed("files", files))
    assert f"model.inputs[0].name: longer than {MAX_TEXT} characters" in _refused(
        _changed("model.inputs.0.name", "x" * (MAX_TEXT + 1)))
    assert "model.inputs[0].shape: more than 64 entries" in _refused(_changed("model.inputs.0.shape", [1] * 65))


def test_missing_fields_are_all_named_at_once() -> None:
    message = _refused({"files": {}, "target": {}})
    for missing in ("target.device", "target.arch", "model", "verification"):
        assert f"{SOURCE}: {missing}: missing (an edgetune manifest has it)" in message
    assert _refused([1, 2]) == f"{SOURCE}: expected an object, found list"


def test_verify_refuses_a_hostile_manifest_before_reading_any_file(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path)
    write_manifest(directory, {**MINIMAL, "verification": {"rtol": "loose", "atol": 1e-4}})
    with pytest.raises(InputError, match=r"manifest.json: verification.rtol: expected a number, found str"):
        verify_artifact(directory)


def test_the_summary_keeps_its_json() -> None:
    build = BuildResult("tiny", "/out/tiny")
    build.targets["host"] = TargetResult("host", latency_ms=0.02, tasks=[{"name": "t", "best_us": 4.0}],
                                         transfer=None, tuning_failed=["t: E: x"])
    build.targets["pi"] = TargetResult("pi", error="target 'pi': no device")
    summary = build.to_json()
    assert list(summary) == ["recipe", "output_dir", "ok", "targets"] and summary["ok"] is False
    assert list(summary["targets"]["host"])[:4] == ["name", "artifact", "artifact_dir", "latency_ms"]
    assert summary["targets"]["host"]["tasks"] == [{"name": "t", "best_us": 4.0}]
    assert list(summary["targets"]["host"])[-2:] == ["error", "wall_s"]
    sent = json.loads(json.dumps(summary))  # as a release's worker hands it over
    assert {name: TargetResult.model_validate(t) for name, t in sent["targets"].items()} == build.targets
