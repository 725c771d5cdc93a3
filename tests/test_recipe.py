"""Recipe validation: good recipes load, bad ones name file, line and field for every problem."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from edgetune.errors import InputError
from edgetune.recipe import Recipe, load_recipe, load_recipe_text, recipe_hash

REPO = Path(__file__).resolve().parent.parent

GOOD = """\
name: demo
model:
  zoo: resnet18
fleet:
  - name: host
    profile: host
tuning:
  trials_per_task: 4
"""


def save_relu_model(path: Path) -> None:
    """A one-node ONNX model whose input `data` has a symbolic batch dimension."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["data"], ["out"])], "relu",
                              [helper.make_tensor_value_info("data", TensorProto.FLOAT, ["N", 3, 224, 224])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3, 224, 224])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path) -> list[str]:
    with pytest.raises(InputError) as info:
        load_recipe(path)
    assert info.value.exit_code == 2
    return info.value.problems


def assert_problem(found: list[str], path: Path, line: int, field: str, fragment: str) -> None:
    prefix = f"{path}:{line}: {field}: "
    assert any(p.startswith(prefix) and fragment in p for p in found), f"no '{prefix}...{fragment}' in {found}"


def test_good_recipe_loads(tmp_path: Path) -> None:
    recipe = load_recipe(write(tmp_path, GOOD))
    assert recipe.name == "demo"
    assert recipe.model.zoo == "resnet18"
    assert recipe.fleet[0].is_local
    assert recipe.tuning.search == "draft-verify" and recipe.tuning.seed == 0
    assert recipe.verify.rtol == 1e-4 and recipe.verify.atol == 1e-4
    assert recipe.source_path == (tmp_path / "recipe.yaml").resolve()
    assert recipe.base_dir == tmp_path.resolve()
    assert recipe.output_dir == (tmp_path / "build").resolve()
    assert recipe.model_path is None


@pytest.mark.parametrize("name", ["host.yaml", "fleet.yaml"])
def test_shipped_recipes_validate(name: str) -> None:
    recipe = load_recipe(REPO / "recipes" / name)
    assert recipe.model.zoo == "resnet18"


def test_fleet_recipe_shape() -> None:
    recipe = load_recipe(REPO / "recipes" / "fleet.yaml")
    by_name = {t.name: t for t in recipe.fleet}
    assert by_name["host"].is_local
    rpc = by_name["rpi4"].connection
    assert rpc is not None and rpc.rpc.key == "rpi4"
    assert (rpc.rpc.tracker_host, rpc.rpc.tracker_port) == ("127.0.0.1", 9190)
    assert by_name["a53-board"].transfer_from == ["rpi4"]
    assert by_name["orin"].profile == "jetson-orin"


def test_onnx_model_and_full_options(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    save_relu_model(tmp_path / "models" / "net.onnx")
    recipe = load_recipe(
        write(
            tmp_path,
            """\
            name: onnx-demo
            model:
              onnx: models/net.onnx
              input_shapes: {data: [1, 3, 224, 224]}
            fleet:
              - name: host
                profile: host
                overrides: {hardware: {cores: 1}, target: {num-cores: 1}}
              - name: pi
                profile: raspberry-pi-4
                connection: {rpc: {tracker: "tracker.lan:9190", key: rpi4}}
              - name: a53
                profile: cortex-a53
                connection: {rpc: {tracker: "tracker.lan:9190", key: a53}}
                transfer_from: [pi]
            tuning:
              time_budget_min: 1.5
              search: draft-verify
              seed: 3
              max_tasks: 5
            verify: {rtol: 1e-3, atol: 1.0e-5}
            output: out/here
            """,
        )
    )
    assert recipe.model_path == (tmp_path / "models" / "net.onnx").resolve()
    assert recipe.model.input_shapes == {"data": [1, 3, 224, 224]}
    assert recipe.output_dir == (tmp_path / "out" / "here").resolve()
    assert recipe.tuning.trials_per_task is None and recipe.tuning.time_budget_min == 1.5
    assert recipe.verify.rtol == 1e-3  # PyYAML leaves `1e-3` as text; it is still a number here


def test_hash_ignores_key_order_and_spelled_out_defaults(tmp_path: Path) -> None:
    reordered = """\
    tuning: {seed: 0, trials_per_task: 4, search: draft-verify}
    fleet:
      - {profile: host, name: host, connection: local}
    model: {zoo: resnet18}
    name: demo
    output: build
    """
    a = load_recipe(write(tmp_path, GOOD, "a.yaml"))
    b = load_recipe(write(tmp_path, reordered, "b.yaml"))
    changed = load_recipe(write(tmp_path, GOOD.replace("trials_per_task: 4", "trials_per_task: 5"), "c.yaml"))
    assert recipe_hash(a) == recipe_hash(b)
    assert recipe_hash(a) != recipe_hash(changed)
    assert len(recipe_hash(a)) == 64


def test_load_recipe_text(tmp_path: Path) -> None:
    recipe = load_recipe_text(GOOD, "<default>", base_dir=tmp_path)
    assert isinstance(recipe, Recipe)
    assert recipe.source_path is None
    assert recipe.output_dir == (tmp_path / "build").resolve()
    with pytest.raises(InputError) as info:
        load_recipe_text(GOOD.replace("resnet18", "vgg"), "<default>", base_dir=tmp_path)
    assert info.value.problems[0].startswith("<default>:3: model.zoo: unknown zoo model 'vgg'")


# Each case: recipe text, then (line, field path, fragment of the message) expected among the problems.
BAD_CASES = {
    "unknown top-level key": (GOOD + "outptu: build\n", 9, "outptu", "unknown field; did you mean 'output'?"),
    "typo in fleet target key": (
        GOOD.replace("profile: host", "profle: host"),
        6,
        "fleet[0].profle",
        "did you mean 'profile'?",
    ),
    "fleet key typo leaves profile missing": (
        GOOD.replace("profile: host", "profle: host"),
        5,
        "fleet[0].profile",
        "required field is missing",
    ),
    "missing model": (GOOD.replace("model:\n  zoo: resnet18\n", ""), 1, "model", "required field is missing"),
    "unknown zoo model": (
        GOOD.replace("resnet18", "resnet19"),
        3,
        "model.zoo",
        "unknown zoo model 'resnet19'; known: resnet18",
    ),
    "onnx file missing": (GOOD.replace("zoo: resnet18", "onnx: missing.onnx"), 3, "model.onnx", "ONNX file not found"),
    "unknown profile": (
        GOOD.replace("profile: host", "profile: rpi5"),
        6,
        "fleet[0].profile",
        "unknown device profile 'rpi5'; known: a100, ",
    ),
    "negative trials": (
        GOOD.replace("trials_per_task: 4", "trials_per_task: -4"),
        8,
        "tuning.trials_per_task",
        "must be at least 0 and at most 100000 (each trial is a measurement",
    ),
    "trials not a number": (
        GOOD.replace("trials_per_task: 4", "trials_per_task: many"),
        8,
        "tuning.trials_per_task",
        "expected a whole number, got 'many'",
    ),
    "neither trials nor budget": (
        GOOD.replace("trials_per_task: 4", "seed: 1"),
        7,
        "tuning",
        "give trials_per_task, time_budget_min, or both",
    ),
    "bad search name": (
        GOOD + "  search: random\n",
        9,
        "tuning.search",
        "expected 'evolutionary' or 'draft-verify', got 'random'",
    ),
    "winograd not a boolean": (
        GOOD + "  winograd: sometimes\n",
        9,
        "tuning.winograd",
        "expected true or false, got 'sometimes'",
    ),
    "tracker without port": (
        GOOD.replace("profile: host\n", "profile: host\n    connection: {rpc: {tracker: host, key: k}}\n"),
        7,
        "fleet[0].connection.rpc.tracker",
        "expected 'host:port'",
    ),
    "tracker port out of range": (
        GOOD.replace(
            "profile: host\n",
            "profile: host\n    connection:\n      rpc:\n        tracker: 'h:70000'\n        key: k\n",
        ),
        9,
        "fleet[0].connection.rpc.tracker",
        "port from 1 to 65535",
    ),
    "connection neither local nor rpc": (
        GOOD.replace("profile: host\n", "profile: host\n    connection: ssh\n"),
        7,
        "fleet[0].connection",
        "expected 'local' or {rpc:",
    ),
    "transfer_from unknown name": (
        GOOD.replace("profile: host\n", "profile: host\n    transfer_from: [rpi4]\n"),
        7,
        "fleet[0].transfer_from[0]",
        "no fleet target named 'rpi4'",
    ),
    "transfer_from itself": (
        GOOD.replace("profile: host\n", "profile: host\n    transfer_from: [host]\n"),
        7,
        "fleet[0].transfer_from[0]",
        "cannot transfer from itself",
    ),
    "bad target name": (GOOD.replace("name: host", "name: My Host"), 5, "fleet[0].name", "expected lowercase letters"),
    "empty fleet": (
        GOOD.replace("fleet:\n  - name: host\n    profile: host\n", "fleet: []\n"),
        4,
        "fleet",
        "at least 1 item",
    ),
    "unknown override section": (
        GOOD.replace("profile: host\n", "profile: host\n    overrides:\n      hardwre: {cores: 1}\n"),
        8,
        "fleet[0].overrides.hardwre",
        "did you mean 'hardware'?",
    ),
    "unknown override field": (
        GOOD.replace("profile: host\n", "profile: host\n    overrides:\n      hardware:\n        corse: 1\n"),
        9,
        "fleet[0].overrides.hardware.corse",
        "did you mean 'cores'?",
    ),
    "bogus mcpu override": (
        GOOD.replace("profile: host\n", "profile: host\n    overrides:\n      target: {mcpu: notacpu}\n"),
        8,
        "fleet[0].overrides.target.mcpu",
        "LLVM does not know CPU 'notacpu'",
    ),
    "YAML syntax error": (GOOD.replace("trials_per_task: 4", "trials_per_task: [4"), 9, "", "invalid YAML"),
}


@pytest.mark.parametrize("text, line, field, fragment", list(BAD_CASES.values()), ids=list(BAD_CASES))
def test_bad_recipe_is_located(tmp_path: Path, text: str, line: int, field: str, fragment: str) -> None:
    path = write(tmp_path, text)
    found = problems(path)
    if field:
        assert_problem(found, path, line, field, fragment)
    else:
        assert any(p.startswith(f"{path}:{line}: ") and fragment in p for p in found), found


def test_both_zoo_and_onnx(tmp_path: Path) -> None:
    (tmp_path / "net.onnx").write_bytes(b"")
    path = write(tmp_path, GOOD.replace("zoo: resnet18", "zoo: resnet18\n  onnx: net.onnx"))
    assert_problem(problems(path), path, 2, "model", "give exactly one of 'zoo'")


def test_duplicate_target_names(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.replace("tuning:", "  - name: host\n    profile: raspberry-pi-4\ntuning:"))
    assert_problem(problems(path), path, 7, "fleet[1].name", "duplicate target name 'host' (also fleet[0])")


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "# nothing here\n")
    assert problems(path) == [f"{path}: the file is empty; expected a YAML mapping of settings"]


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    path = write(tmp_path, "- name: demo\n")
    assert problems(path)[0].startswith(f"{path}:1: expected a YAML mapping")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert problems(path) == [f"{path}: file not found"]


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "name: again\n")
    assert problems(path)[0].startswith(f"{path}:9: duplicate key 'name'")


def test_several_problems_reported_at_once(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """\
        name: demo
        model:
          zoo: resnet19
        fleet:
          - name: host
            profle: host
          - name: host
            profile: rpi5
            transfer_from: [nobody]
        tuning:
          trials_per_task: -1
          search: random
        verify: {rtol: -1}
        outptu: build
        """,
    )
    found = problems(path)
    assert_problem(found, path, 3, "model.zoo", "unknown zoo model")
    assert_problem(found, path, 5, "fleet[0].profile", "required field is missing")
    assert_problem(found, path, 6, "fleet[0].profle", "did you mean 'profile'?")
    assert_problem(found, path, 7, "fleet[1].name", "duplicate target name")
    assert_problem(found, path, 8, "fleet[1].profile", "unknown device profile 'rpi5'")
    assert_problem(found, path, 9, "fleet[1].transfer_from[0]", "no fleet target named 'nobody'")
    assert_problem(found, path, 11, "tuning.trials_per_task", "must be at least 0")
    assert_problem(found, path, 12, "tuning.search", "expected 'evolutionary' or 'draft-verify'")
    assert_problem(found, path, 13, "verify.rtol", "must be at least 0")
    assert_problem(found, path, 14, "outptu", "did you mean 'output'?")
    assert len(found) == 10
    assert [int(p.split(":")[1]) for p in found] == sorted(int(p.split(":")[1]) for p in found)
