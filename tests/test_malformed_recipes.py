"""A corpus of malformed recipes, each run through the real `edgetune validate` and `edgetune build`.

Every one must end with exit code 2 and a message naming the file, the line and the field and what
was expected; no traceback, within 10 s and 1 GB, writing nothing. The recipes are in
tests/malformed_recipes/ (a header line `# expect: LINE FIELD FRAGMENT` says what the message must
hold, `-` for none); those too big to commit are generated here. Some need a file beside them (an
ONNX file, a directory that is in the way): SETUP makes those.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgetune.ownership import mark_owned

CORPUS = Path(__file__).resolve().parent / "malformed_recipes"
EXPECT = re.compile(r"# expect: (\S+) (\S+) (.+)")
SECONDS_LIMIT = 10.0
MEMORY_LIMIT = 1024**3
MAX_ERROR_LINES = 51  # the first 50 problems and "... and N more problems"


@dataclass(frozen=True)
class Case:
    """One malformed recipe and what its error message must hold."""

    stem: str
    content: bytes
    line: str
    field: str
    fragment: str


def _tiny_onnx(symbolic_batch: bool = False, opset: bool = True, input_name: str = "data") -> bytes:
    from onnx import TensorProto, helper

    shape = ["N" if symbolic_batch else 1, 3, 8, 8]
    graph = helper.make_graph([helper.make_node("Relu", [input_name], ["out"])], "relu",
                              [helper.make_tensor_value_info(input_name, TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if not opset:
        del model.opset_import[:]
    return model.SerializeToString()


def _write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(directory: Path) -> None:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)

    return setup


SETUP: dict[str, Callable[[Path], None]] = {
    "onnx_not_onnx": _write("model.onnx", "this is a text file, not a model\n"),
    "onnx_truncated": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx()[: len(_tiny_onnx()) // 2]),
    "onnx_no_opset": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx(opset=False)),
    "onnx_garbage": _write("model.onnx", random.Random(0).randbytes(4096)),
    "onnx_empty": _write("model.onnx", b""),
    "onnx_directory": lambda d: (d / "model.onnx").mkdir(),
    "onnx_shapes_unknown_input": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx()),
    "onnx_shapes_rank": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx()),
    "onnx_nul_in_input_name": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx(input_name="da\0ta")),
    "onnx_dynamic_without_shapes": lambda d: (d / "model.onnx").write_bytes(_tiny_onnx(symbolic_batch=True)),
    "output_file": _write("notes.txt", "mine\n"),
    "output_under_file": _write("notes.txt", "mine\n"),
    "records_dir_file": _write("notes.txt", "mine\n"),
    "output_foreign": _write("out/demo/notes.txt", "my own work, not edgetune's\n"),
    "output_foreign_target_dir": lambda d: (mark_owned(d / "out" / "demo"), _write("out/demo/host/notes.txt",
                                                                                   "mine\n")(d)),
}

HEAD = "name: demo\nmodel: {zoo: tiny_cnn}\ntuning: {trials_per_task: 2}\noutput: out\nfleet:\n"


def _generated() -> list[Case]:
    """Recipes too big to commit: sizes around the limits on file size, values and problems shown."""
    same_target = "  - {name: host, profile: host}\n"
    chain = "".join(f"  - {{name: t{i}, profile: host, transfer_from: [t{(i + 1) % 4000}]}}\n" for i in range(4000))
    many = "".join(f"  - {{name: t{i}, profile: host}}\n" for i in range(300))
    return [
        Case("oversize", (HEAD + same_target + "#" + "x" * 300_000 + "\n").encode(), "-", "-",
             "a YAML file may be at most 262144 bytes"),
        Case("duplicates_200000", (HEAD + same_target * 200_000).encode(), "-", "-",
             "a YAML file may be at most 262144 bytes"),
        Case("duplicates_8000", (HEAD + same_target * 8000).encode(), "7", "fleet[1].name",
             "duplicate target name 'host' (also fleet[0])"),
        Case("transfer_circle_4000", (HEAD + chain).encode(), "5", "fleet", "must have at most 256 item(s)"),
        Case("fleet_300_targets", (HEAD + many).encode(), "5", "fleet", "must have at most 256 item(s)"),
        Case("flat_list_110000", (HEAD + same_target + "verify: {rtol: [" + "1," * 110_000 + "1]}\n").encode(),
             "7", "verify.rtol", "holds more than 100000 values"),
        Case("not_utf8", (HEAD + same_target).encode() + b"# caf\xe9\n", "-", "-", "cannot read"),
    ]


def _corpus() -> list[Case]:
    cases = []
    for path in sorted(CORPUS.glob("*.yaml")):
        content = path.read_bytes()
        match = EXPECT.search(content.decode())
        assert match, f"{path.name}: no '# expect: LINE FIELD FRAGMENT' header"
        cases.append(Case(path.stem, content, *match.groups()))
    return cases + _generated()


CASES = _corpus()


def _snapshot(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under `root` with (is directory, size, modification time)."""
    return {str(p.relative_to(root)): (p.is_dir(), p.lstat().st_size, p.lstat().st_mtime_ns) for p in root.rglob("*")}


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    max_rss_bytes: int


def run_measured(args: list[str], cwd: Path, env: dict[str, str], timeout: float = 60) -> Run:
    """`python -m edgetune ARGS` as a user runs it, with its own wall time and peak resident memory."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        child = subprocess.Popen([sys.executable, "-m", "edgetune", *args], cwd=cwd, env=env, stdout=out, stderr=err)
        killer = threading.Timer(timeout, child.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(child.pid, 0)
        finally:
            killer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.monotonic() - started
        out.seek(0)
        err.seek(0)
        return Run(child.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                   seconds, usage.ru_maxrss * 1024)


def test_the_corpus_covers_at_least_60_recipes() -> None:
    assert len(CASES) >= 60
    assert len({c.stem for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_malformed_recipe_is_refused_cleanly(tmp_path: Path, case: Case) -> None:
    """`edgetune validate` and `edgetune build`, each in a sandbox of its own, side by side (two processes
    that mostly wait on their imports: the pair takes about the time of one)."""
    with ThreadPoolExecutor(2) as pool:
        checks = [pool.submit(_refused_cleanly, tmp_path / command, case, command) for command in ("validate", "build")]
        for check in checks:
            check.result()


def _refused_cleanly(directory: Path, case: Case, command: str) -> None:
    sandbox = directory / "sandbox"
    home = sandbox / "home"
    home.mkdir(parents=True)
    recipe = sandbox / f"{case.stem}.yaml"
    recipe.write_bytes(case.content)
    SETUP.get(case.stem, lambda directory: None)(sandbox)
    before = _snapshot(sandbox)

    run = run_measured([command, recipe.name], cwd=sandbox, env={**os.environ, "HOME": str(home)})

    assert run.returncode == 2, f"{command}: {run.stdout}{run.stderr}"
    assert "Traceback" not in run.stderr + run.stdout, f"{command}: {run.stderr}"
    where = f"{recipe.name}: " if case.line == "-" else f"{recipe.name}:{case.line}: "
    if case.field != "-":
        where += f"{case.field}: "
    assert where in run.stderr, f"{command}: no '{where}' in:\n{run.stderr}"
    assert case.fragment in run.stderr, f"{command}: no '{case.fragment}' in:\n{run.stderr}"
    assert len(run.stderr.splitlines()) <= MAX_ERROR_LINES, run.stderr[:2000]
    assert run.seconds < SECONDS_LIMIT, f"{command}: {run.seconds:.1f} s"
    assert run.max_rss_bytes < MEMORY_LIMIT, f"{command}: {run.max_rss_bytes} bytes"
    assert _snapshot(sandbox) == before, f"{command}: bad input must write nothing"


def test_many_problems_are_cut_to_the_first_50() -> None:
    case = next(c for c in CASES if c.stem == "duplicates_8000")
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "dups.yaml").write_bytes(case.content)
        run = run_measured(["validate", "dups.yaml"], cwd=Path(directory), env=dict(os.environ))
    lines = run.stderr.splitlines()
    assert run.returncode == 2
    assert len(lines) == 51 and lines[-1].endswith("... and 7950 more problems"), lines[-3:]
    assert lines[0].startswith("error: dups.yaml:5: fleet: must have at most 256 item(s)")
    assert lines[1].startswith("error: dups.yaml:7: fleet[1].name: duplicate target name 'host' (also fleet[0])")
