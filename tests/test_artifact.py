"""Packaging without TVM in the loop: reproducible archives and checksum verification."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edgetune.archive import archive_directory
from edgetune.package.artifact import save_arrays, write_artifact_files, write_manifest
from edgetune.package.verify import checksum_problems, read_manifest

CONTEXT = {
    "model_name": "m", "target_name": "host", "recipe_name": "r", "recipe_hash": "0" * 64, "profile": "host",
    "tvm_target": "{}", "device": "cpu", "edgetune_version": "0", "tvm_package": "apache-tvm==0.27.0.post1",
    "rtol": 1e-4, "atol": 1e-4,
    "measured_on": "here", "tuned_text": "1 ms", "untuned_text": "2 ms", "reference_text": "1 ms",
    "arch": "x86_64", "cxx": "g++", "output_names": ["logits"], "cpu_threads": 2, "cpu_thread_spin_count": 0,
    "thread_wait_chosen_by": "measured",
    "inputs": [{"name": "data", "shape": [6], "dl_code": "kDLFloat", "bits": 32, "index_limit": None,
                "index_from": None}],
}


def make_artifact(root: Path, library_bytes: bytes = b"\x7fELF fake library") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    library = root / "lib.so"
    library.write_bytes(library_bytes)
    directory = root / "host"
    write_artifact_files(directory, library=library, sample_inputs={"data": np.arange(6, dtype="float32")},
                         reference_outputs={"logits": np.ones(3, dtype="float32")}, template_context=CONTEXT)
    write_manifest(directory, {"k": 1})
    return directory


def test_manifest_lists_every_file_with_its_sha256(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path)
    manifest = read_manifest(directory)
    assert sorted(manifest["files"]) == ["README.md", "deploy/CMakeLists.txt", "deploy/deploy.cc", "io.json",
                                         "model.so", "reference_output.npz", "run.py", "sample_input.npz"]
    assert checksum_problems(directory, manifest) == []


def test_checksum_problems_name_altered_missing_and_extra_files(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path)
    (directory / "model.so").write_bytes(b"tampered")
    (directory / "README.md").unlink()
    (directory / "extra.txt").write_text("x")
    found = "\n".join(checksum_problems(directory, read_manifest(directory)))
    assert "model.so: sha256 differs" in found
    assert "README.md: missing" in found
    assert "extra.txt: not listed" in found


def test_same_inputs_give_byte_identical_archives(tmp_path: Path) -> None:
    first = archive_directory(make_artifact(tmp_path / "a"), tmp_path / "a.tar.gz").read_bytes()
    second = archive_directory(make_artifact(tmp_path / "b"), tmp_path / "b.tar.gz").read_bytes()
    assert first == second
    different = archive_directory(make_artifact(tmp_path / "c", b"other"), tmp_path / "c.tar.gz").read_bytes()
    assert different != first


def test_saved_arrays_do_not_depend_on_the_clock(tmp_path: Path) -> None:
    arrays = {"b": np.zeros((2, 2), "float32"), "a": np.arange(3)}
    save_arrays(tmp_path / "x.npz", arrays)
    save_arrays(tmp_path / "y.npz", dict(reversed(list(arrays.items()))))
    assert (tmp_path / "x.npz").read_bytes() == (tmp_path / "y.npz").read_bytes()
    with np.load(tmp_path / "x.npz") as loaded:
        np.testing.assert_array_equal(loaded["a"], arrays["a"])


def test_manifest_is_stable_json(tmp_path: Path) -> None:
    directory = make_artifact(tmp_path)
    text = (directory / "manifest.json").read_text()
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
