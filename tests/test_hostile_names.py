"""Names from a model, its file or a recipe never become code: hostile names build, run and stay inert.

Every payload below tries to create a PWNED file when it is compiled, imported, run or rendered;
the build must succeed, verify, and leave no such file anywhere.
"""

from __future__ import annotations

import html
import json
import string
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from markdown_it import MarkdownIt

from edgetune.errors import InputError
from edgetune.ownership import MARKER_NAME
from edgetune.package.artifact import write_artifact_files, write_manifest
from edgetune.package.escaping import code_value, markdown_text, visible_text
from tests.conftest import run_edgetune

MARKER = "PWNED"
HOSTILE = [
    "a\nb", "quote \" and ' and `", "back\\slash\\", "*/ /* comment", '""" triple', "'''", "NUL\x00byte",
    "non-ASCII é ✓ 模型 🙂", "$(touch x) `touch x`", "<script>alert(1)</script>", "[link](javascript:alert(1))",
    "| cell | # heading *em* _em_ ~~s~~", "\r\n\t\x0b\x0c\x1b[31m", "line\u2028sep\u2029para\u0085next",
    "bidi \u202eevil\u202c", "&amp; &#60; \\n", "    indented", "trailing  ", " ", "", "1. list", "- item",
    "> quote", "===",
]


def _names(marker: Path) -> dict[str, str]:
    """Input and output names that are valid C++/Python/Markdown payloads, each creating `marker`."""
    return {
        "in_cpp": f'x"\n#include <cstdlib>\nstatic int pwned = std::system("touch {marker}");\n// */ é',
        "in_py": f"y'''\n\"\"\";open({str(marker)!r}, 'w');\"\"\"\n*/ \\ \x1b[31m $(touch {marker}) ✓",
        "out_py": f'z"""\n__import__("os").system("touch {marker}")\n""" <script>alert(1)</script> | # *x* `c`',
        "out_savez": "file",  # np.savez(file, **outputs) would fail on an output called `file`
    }


# --- the escaping functions, on their own ---------------------------------------------------------

@pytest.mark.parametrize("value", HOSTILE)
def test_markdown_text_renders_as_exactly_its_characters(value: str) -> None:
    escaped = markdown_text(value)
    assert "\n" not in escaped and "\x00" not in escaped and "\r" not in escaped
    rendered = MarkdownIt("commonmark").render(escaped)
    if not value:
        assert rendered == ""
        return
    assert rendered.startswith("<p>") and rendered.endswith("</p>\n")
    body = rendered[len("<p>"):-len("</p>\n")]
    assert "<" not in body  # no tag, no link, no emphasis: text only
    assert html.unescape(body) == visible_text(value)


@pytest.mark.parametrize("value", HOSTILE)
def test_markdown_text_stays_inside_its_table_cell(value: str) -> None:
    table = f"| name | x |\n|---|---|\n| {markdown_text(value)} | after |\n"
    rendered = MarkdownIt("commonmark").enable("table").render(table)
    cells = rendered.split("<tbody>")[1].split("<td>")[1:]
    assert len(cells) == 2 and cells[1].startswith("after")
    assert html.unescape(cells[0].split("</td>")[0]) == visible_text(value)


def test_visible_text_spells_out_every_line_break_and_control() -> None:
    assert visible_text("a\nb\x00c\u2028d\u202ee\x1bf") == "a\\u{000a}b\\u{0000}c\\u{2028}d\\u{202e}e\\u{001b}f"
    assert visible_text("plain é ✓ 模型 🙂 \"'\\") == "plain é ✓ 模型 🙂 \"'\\"
    assert markdown_text("a.b") == "a\\.b"
    assert all(markdown_text(c) == "\\" + c for c in string.punctuation)


@pytest.mark.parametrize("value", [
    "a\nb", "a\rb", 'a"b', "a'b", "a`b", "a\\b", "*/", "/*", "//", '"""', "a\x00b", "é", "✓", "$(x)", "a#b",
    "a(b)", "a{b}", "a;b", "a\u2028b", "a\x1bb", 1.5, True, None, ["x"], b"x",
])
def test_code_value_refuses_anything_but_integers_and_plain_words(value: object) -> None:
    with pytest.raises(InputError, match="cannot be written into generated source"):
        code_value(value)


def test_code_value_passes_integers_and_plain_words() -> None:
    assert [code_value(v) for v in (3, -1, "kDLFloat", "x86_64", "aarch64-linux-gnu-g++", "1, 3")] == \
        [3, -1, "kDLFloat", "x86_64", "aarch64-linux-gnu-g++", "1, 3"]


# --- the artifact's files, rendered with hostile names (no TVM) -----------------------------------

def _hostile_context(names: dict[str, str]) -> dict:
    return {
        "model_name": HOSTILE[0] + HOSTILE[4], "target_name": "host", "recipe_name": HOSTILE[9],
        "recipe_hash": "0" * 64, "profile": HOSTILE[3], "tvm_target": json.dumps({"kind": HOSTILE[5]}),
        "device": "cpu", "edgetune_version": "0", "tvm_package": "apache-tvm==0.27.0.post1", "rtol": 1e-4,
        "atol": 1e-4, "measured_on": HOSTILE[10], "tuned_text": "1 ms", "untuned_text": "2 ms",
        "reference_text": "1 ms", "arch": "x86_64", "cxx": "g++", "cpu_threads": 2, "cpu_thread_spin_count": 0,
        "thread_wait_chosen_by": "measured",
        "output_names": [names["out_py"], names["out_savez"]],
        "inputs": [{"name": names["in_cpp"], "shape": [1, 4], "dl_code": "kDLFloat", "bits": 32, "index_limit": None,
                    "index_from": None},
                   {"name": names["in_py"], "shape": [1, 4], "dl_code": "kDLInt", "bits": 64, "index_limit": 7,
                    "index_from": 0}],
    }


def _write_hostile_artifact(root: Path, names: dict[str, str]) -> Path:
    (root / "lib.so").write_bytes(b"\x7fELF fake")
    directory = root / "host"
    write_artifact_files(directory, library=root / "lib.so",
                         sample_inputs={names["in_cpp"]: np.zeros((1, 4), "float32"),
                                        names["in_py"]: np.ones((1, 4), "int64")},  # ids into a 7-row table
                         reference_outputs={names["out_py"]: np.zeros((1, 4), "float32"),
                                            names["out_savez"]: np.zeros((1, 4), "float32")},
                         template_context=_hostile_context(names))
    return directory


def _assert_no_raw_names(directory: Path, names: list[str]) -> None:
    """Code holds no name at all; the README shows them escaped, so no payload line appears as written."""
    code = [(directory / f).read_text() for f in ("run.py", "deploy/deploy.cc", "deploy/CMakeLists.txt")]
    for text in code:
        assert MARKER not in text and "<script>" not in text and "é" not in text
    compile(code[0], "run.py", "exec")  # still Python
    readme = (directory / "README.md").read_text()
    payload_lines = [line for name in names for line in name.splitlines() if MARKER in line or "<script>" in line]
    assert payload_lines and not [line for line in payload_lines if line in readme]


def test_generated_files_hold_no_name_and_io_json_holds_them_all(tmp_path: Path) -> None:
    names = _names(tmp_path / MARKER)
    directory = _write_hostile_artifact(tmp_path, names)
    _assert_no_raw_names(directory, list(names.values()))
    spec = json.loads((directory / "io.json").read_text())
    assert [i["name"] for i in spec["inputs"]] == [names["in_cpp"], names["in_py"]]
    assert [o["name"] for o in spec["outputs"]] == [names["out_py"], names["out_savez"]]
    assert spec["inputs"][0]["shape"] == [1, 4] and spec["inputs"][0]["dtype"] == "float32"
    assert [(i["index_from"], i["index_limit"]) for i in spec["inputs"]] == [(None, None), (0, 7)] and spec["inputs"][1]["dtype"] == "int64"
    assert (directory / "io.json").read_bytes().isascii()
    readme = (directory / "README.md").read_text()
    assert "\\<script\\>" in readme
    assert "holds ids into a table of 7 rows" in readme  # after the input's name, escaped
    assert readme.startswith("# " + r'a\\u\{000a\}b\"\"\" triple' + " for host\n")


def test_a_code_template_refuses_a_name_pasted_into_it(tmp_path: Path) -> None:
    names = _names(tmp_path / MARKER)
    context = _hostile_context(names)
    context["arch"] = 'x86_64\nexecute_process(COMMAND touch PWNED)'  # CMakeLists.txt prints the arch
    (tmp_path / "lib.so").write_bytes(b"x")
    with pytest.raises(InputError, match="generated source"):
        write_artifact_files(tmp_path / "host", library=tmp_path / "lib.so", sample_inputs={
            n["name"]: np.zeros((1, 4), "float32") for n in context["inputs"]}, reference_outputs={},
            template_context=context)
    assert not (tmp_path / "host").exists() and list(tmp_path.iterdir()) == [tmp_path / "lib.so"]


def test_a_nul_in_a_tensor_name_is_a_clear_error_not_a_lost_array(tmp_path: Path) -> None:
    from edgetune.package.artifact import save_arrays

    with pytest.raises(InputError, match=r"'in\\x00put'.*NUL character cannot be stored in an .npz"):
        save_arrays(tmp_path / "x.npz", {"in\x00put": np.zeros(2)})
    assert not (tmp_path / "x.npz").exists()


def test_the_ownership_marker_is_neither_listed_nor_archived(tmp_path: Path) -> None:
    from edgetune.archive import archive_directory
    from edgetune.package.verify import checksum_problems, read_manifest

    directory = _write_hostile_artifact(tmp_path, _names(tmp_path / MARKER))
    write_manifest(directory, {})
    assert (directory / MARKER_NAME).is_file()
    assert MARKER_NAME not in read_manifest(directory)["files"]
    assert checksum_problems(directory, read_manifest(directory)) == []
    with tarfile.open(archive_directory(directory, tmp_path / "host.tar.gz")) as archive:
        assert not [n for n in archive.getnames() if MARKER_NAME in n]


# --- the real build, with the C++ deploy program compiled and run -------------------------------

def _hostile_model(path: Path, names: dict[str, str]) -> None:
    import onnx
    from onnx import TensorProto, helper

    total = "sum\n*/ \"\"\" $(x)"
    nodes = [helper.make_node("Add", [names["in_cpp"], names["in_py"]], [total], name="add\n\"\"\""),
             helper.make_node("Relu", [total], [names["out_py"]]),
             helper.make_node("Neg", [total], [names["out_savez"]])]
    graph = helper.make_graph(
        nodes, 'graph"""\n', [helper.make_tensor_value_info(names[n], TensorProto.FLOAT, [1, 4])
                              for n in ("in_cpp", "in_py")],
        [helper.make_tensor_value_info(names[n], TensorProto.FLOAT, [1, 4]) for n in ("out_py", "out_savez")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


@pytest.mark.slow
def test_hostile_names_build_verify_and_run_without_running_their_payloads(tmp_path: Path) -> None:
    names = _names(tmp_path / MARKER)
    # A file name cannot hold '/' or NUL: its payload creates PWNED in whatever directory it runs in.
    model_file = f'm"""\n__import__("os").system("touch {MARKER}");open("{MARKER}","w")\n"""$(touch {MARKER})é.onnx'
    _hostile_model(tmp_path / model_file, names)
    recipe = {"name": "hostile", "model": {"onnx": model_file}, "fleet": [{"name": "host", "profile": "host"}],
              "tuning": {"trials_per_task": 0}, "package": {"bundle_runtime": True}, "output": "out"}
    (tmp_path / "hostile.yaml").write_text(yaml.safe_dump(recipe, allow_unicode=True))
    run = run_edgetune("build", "hostile.yaml", "--json", "summary.json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    host = json.loads((tmp_path / "summary.json").read_text())["targets"]["host"]
    assert host["verified"] and host["verification"] == "matched", host
    directory = Path(host["artifact_dir"])
    methods = json.loads((directory / "manifest.json").read_text())["verification"]["methods"]
    assert "C++ deploy program, this machine" in methods  # deploy.cc was compiled and run to verify the artifact
    _assert_no_raw_names(directory, [*names.values(), model_file])

    check = subprocess.run([sys.executable, str(directory / "run.py"), "--check", "--output", "out.npz"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "OK" in check.stdout, check.stdout + check.stderr
    with np.load(tmp_path / "out.npz") as outputs, np.load(directory / "sample_input.npz") as inputs:
        total = inputs[names["in_cpp"]] + inputs[names["in_py"]]
        np.testing.assert_allclose(outputs[names["out_savez"]], -total, rtol=1e-6)
        np.testing.assert_allclose(outputs[names["out_py"]], np.maximum(total, 0), rtol=1e-6)

    report = (tmp_path / "out" / "hostile" / "report.html").read_text()
    assert "#include &lt;cstdlib&gt;" in report and "<cstdlib>" not in report  # the input's name, as text
    assert not [p for p in tmp_path.rglob(MARKER)] and not Path(MARKER).exists()
