"""The package's shape: data flows one way through the pipeline, so no module imports a later stage and
no import goes round in a circle (function-level imports included: they are how a cycle hides)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "edgetune"

LAYERS = [
    # the bottom: no stage, no device
    {"errors", "yamlsource", "ownership", "archive", "runtime", "isolated", "machine_load", "thread_pool"},
    {"profiles", "recipe", "toolchains"},  # the recipe, its devices' profiles and their compilers
    {"fleet"},  # connections to devices: RPC tracker, SSH, emulated boards, on-device sessions
    {"frontend", "reference"},  # stage: import
    {"tuning"},  # stage: tune
    {"compile", "cuda_precompile", "selection", "weight_packing"},  # stage: compile
    {"package"},  # stages: package, verify
    {"devices"},  # where a target's code runs (here, over RPC, nowhere): tuning's runners, package's checks
    {"report"},
    {"build"},  # one target's context and its stages in order
    {"pipeline"},
    {"workers"},  # where a release's units run: a process pool or Ray
    {"release"},  # several recipes: one summary, one exit code
    {"cli", "__main__"},
]
"""Each top-level module or folder of edgetune/, by layer: a module may import its own layer and those above."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The edgetune modules `path` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("edgetune"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("edgetune"))
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) == 1:
        return None  # edgetune/__init__.py: the version only
    return next(i for i, members in enumerate(LAYERS) if parts[1] in members)


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _modules() if m != "edgetune" and not any(m.split(".")[1] in layer for layer in LAYERS)]
    assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_no_module_imports_a_later_stage() -> None:
    backwards = [f"{module} -> {dependency}" for module, dependencies in _graph().items()
                 for dependency in dependencies
                 if _layer(module) is not None and _layer(dependency) is not None
                 and _layer(dependency) > _layer(module)]
    assert not backwards, "\n".join(sorted(backwards))


def test_no_import_cycles() -> None:
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dependency in sorted(graph[module]):
            if state.get(dependency) == 1:
                cycles.append(" -> ".join(path[path.index(dependency):] + [dependency]))
            elif dependency not in state:
                visit(dependency, path + [dependency])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_no_function_over_80_lines() -> None:
    long = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80]
    assert not long, "\n".join(long)
