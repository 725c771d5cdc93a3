"""edgetune removes or replaces only directories it created (they carry its marker), and replaces them
by writing beside and renaming; anything else is refused with the path named, exit 2, nothing touched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from edgetune.errors import InputError
from edgetune.ownership import MARKER_NAME, is_owned
from edgetune.package.artifact import claim_build_directory, write_artifact_files
from tests.conftest import run_edgetune, write_tiny_recipe
from tests.test_artifact import CONTEXT


def _write(directory: Path, library: Path) -> None:
    write_artifact_files(directory, library=library, sample_inputs={"data": np.arange(6, dtype="float32")},
                         reference_outputs={"logits": np.ones(3, dtype="float32")}, template_context=CONTEXT)


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_an_artifact_directory_edgetune_made_is_replaced_whole(tmp_path: Path) -> None:
    library = tmp_path / "lib.so"
    library.write_bytes(b"one")
    _write(tmp_path / "out" / "host", library)
    assert is_owned(tmp_path / "out" / "host")
    (tmp_path / "out" / "host" / "stale.txt").write_text("from the last build")
    library.write_bytes(b"two")
    _write(tmp_path / "out" / "host", library)
    assert (tmp_path / "out" / "host" / "model.so").read_bytes() == b"two"
    assert not (tmp_path / "out" / "host" / "stale.txt").exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["host"]  # no staging or old copy left beside it


@pytest.mark.parametrize("kind", ["files", "symlink", "file"])
def test_a_directory_edgetune_did_not_make_is_refused_and_untouched(tmp_path: Path, kind: str) -> None:
    library = tmp_path / "lib.so"
    library.write_bytes(b"x")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    target = tmp_path / "out" / "host"
    target.parent.mkdir()
    if kind == "files":
        (tmp_path / "mine").rename(target)
    elif kind == "symlink":
        target.symlink_to(mine, target_is_directory=True)
    else:
        target.write_text("a file where the artifact would go")
    before = _snapshot(tmp_path)
    with pytest.raises(InputError, match=str(target)):
        _write(target, library)
    assert _snapshot(tmp_path) == before


def test_claiming_a_build_directory_names_every_foreign_path_and_marks_nothing(tmp_path: Path) -> None:
    build = tmp_path / "out" / "tiny"
    (build / "host").mkdir(parents=True)
    (build / "host" / "notes.txt").write_text("mine")
    (build / MARKER_NAME).write_text("{}")  # the build directory is edgetune's, this target's directory is not
    (build / "gpu").mkdir()
    (build / "gpu" / "data.bin").write_bytes(b"\0")
    before = _snapshot(tmp_path)
    with pytest.raises(InputError) as error:
        claim_build_directory(build, ["host", "gpu", "new"])
    assert [p.split(": ")[0] for p in error.value.problems] == [str(build / "host"), str(build / "gpu")]
    assert _snapshot(tmp_path) == before
    claim_build_directory(build, ["new"])
    assert is_owned(build) and is_owned(build / "work") and is_owned(build / "work" / "new")


def test_the_runtime_cache_is_not_replaced_when_someone_else_made_it(tmp_path: Path, monkeypatch) -> None:
    from importlib import metadata

    from edgetune.package.runtime import runtime_files
    from edgetune.profiles import machine_isa

    monkeypatch.setenv("EDGETUNE_CACHE", str(tmp_path))
    versions = f"{metadata.version('apache-tvm')}-{metadata.version('apache-tvm-ffi')}-{machine_isa()}"
    cache = tmp_path / "runtime" / versions
    cache.mkdir(parents=True)
    (cache / "keep.txt").write_text("not edgetune's")
    with pytest.raises(InputError, match=str(cache)):
        runtime_files(machine_isa())
    assert [p.name for p in cache.iterdir()] == ["keep.txt"]
    (cache / "keep.txt").unlink()
    files = runtime_files(machine_isa())  # an empty directory is filled, and marked
    assert is_owned(files.lib_dir) and (files.lib_dir / "libtvm_runtime.so").is_file()


def test_the_runtime_cache_is_filled_beside_its_entry_and_builds_filling_it_at_once_share_one(tmp_path: Path,
                                                                                                   monkeypatch) -> None:
    """Every build's verify stage reads this cache: two builds at once (a release's workers, the tests' two) once
    copied into the entry itself, where one could read a library the other was still writing."""
    import shutil
    import threading

    from edgetune.package import runtime
    from edgetune.profiles import machine_isa

    monkeypatch.setenv("EDGETUNE_CACHE", str(tmp_path))
    written: list[Path] = []
    copy = shutil.copyfile

    def recorded(source, destination):
        written.append(Path(destination))
        return copy(source, destination)

    monkeypatch.setattr(runtime.shutil, "copyfile", recorded)
    results: list[Path] = []
    builds = [threading.Thread(target=lambda: results.append(runtime.runtime_files(machine_isa()).lib_dir))
              for _ in range(2)]
    for build in builds:
        build.start()
    for build in builds:
        build.join()
    [entry] = set(results)
    assert written and all(path.parent != entry for path in written)  # never under the final name
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no copy left beside it
    for name, member in runtime._WHEEL_LIBRARY_PATHS.items():
        assert (entry / Path(member).name).read_bytes() == runtime._installed_file(name, member).read_bytes()
    assert is_owned(entry)


@pytest.mark.slow
def test_build_replaces_its_own_artifact_and_refuses_a_users_directory(tmp_path: Path) -> None:
    write_tiny_recipe(tmp_path, trials=0)
    first = run_edgetune("build", "tiny.yaml", cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    build = tmp_path / "out" / "tiny"
    artifact, archive = build / "host", build / "host.tar.gz"
    assert is_owned(build) and is_owned(artifact) and is_owned(build / "work" / "host")

    (artifact / "stale.txt").write_text("left by hand in edgetune's directory")
    archive.unlink()  # the artifact is no longer reusable: the second build packages it again
    second = run_edgetune("build", "tiny.yaml", "--json", "summary.json", cwd=tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["targets"]["host"]["verified"]
    assert is_owned(artifact) and not (artifact / "stale.txt").exists() and archive.is_file()
    assert not [p.name for p in build.iterdir() if p.name.startswith(".host")]  # nothing left beside it
    verify = run_edgetune("verify", str(artifact), cwd=tmp_path)
    assert verify.returncode == 0, verify.stdout + verify.stderr

    os.rename(artifact, tmp_path / "moved")  # the user puts their own directory where the artifact was
    artifact.mkdir()
    (artifact / "results.csv").write_text("the user's numbers\n")
    before = _snapshot(tmp_path)
    refused = run_edgetune("build", "tiny.yaml", cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert str(artifact) in refused.stderr.replace("\n", "") and "Traceback" not in refused.stderr
    assert _snapshot(tmp_path) == before
