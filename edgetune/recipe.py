"""The recipe: which model to tune, for which fleet of devices, with what budget.

`load_recipe` reports every problem in one InputError, each located in the recipe file
("recipes/x.yaml:7: fleet[1].profile: ..."). Structure is checked by the pydantic models; what
depends on the world outside the file (device profiles, the ONNX file, other fleet entries) is
checked against the raw data, so those problems are reported even when the structure is broken.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from edgetune import profiles
from edgetune.errors import InputError
from edgetune.ownership import foreign_directory_problem
from edgetune.yamlsource import (
    InvalidData,
    Problem,
    YamlDocument,
    YamlFloat,
    display_path,
    excerpt,
    in_range,
    parse_yaml,
    read_yaml,
    validate,
)

ZOO_MODELS = ("resnet18", "mobilenet_v2", "tiny_cnn")
"""Built-in models (mirrors edgetune.frontend.zoo.ZOO_NAMES without importing the frontend)."""

ZOO_INPUT = "data"
"""The one input every zoo model has (mirrors edgetune.frontend.zoo.INPUT_NAME)."""

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"expected lowercase letters, digits, '-' or '_', 1 to 64 of them, starting with a letter or digit "
            f"(it names a directory), got {excerpt(repr(value))}"
        )
    return value


Name = Annotated[str, AfterValidator(_check_name)]


def _check_path_text(value: str) -> str:
    if "\0" in value:
        raise ValueError(f"a path cannot contain a NUL character, got {excerpt(repr(value))}")
    return value


PathText = Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(_check_path_text)]
"""A file system path as written in a recipe (relative to the recipe file)."""

ShortText = Annotated[str, Field(min_length=1, max_length=255)]
"""A host name, user name or RPC key."""

TimeoutSeconds = Annotated[YamlFloat, in_range(0, 3600, "seconds one measurement may wait; no kernel takes an hour",
                                                low_open=True)]

MAX_INPUT_ELEMENTS = 2**28
"""Most elements one model input may have: sample inputs and reference runs hold it in memory (1 GiB of float32)."""

Dim = Annotated[int, in_range(1, 2**20, "elements along one dimension")]


def _check_elements(shape: list[int]) -> list[int]:
    if math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise ValueError(f"{math.prod(shape)} elements; an input may have at most {MAX_INPUT_ELEMENTS} "
                         "(it is generated and held in memory to verify the model)")
    return shape


Shape = Annotated[list[Dim], Field(min_length=1, max_length=8), AfterValidator(_check_elements)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSpec(_Strict):
    """The network: a built-in zoo model, an ONNX file or a torch.export program (exactly one)."""

    zoo: str | None = None
    onnx: PathText | None = None
    """Path relative to the recipe file."""
    exported_program: PathText | None = None
    """A `torch.export.save` file (.pt2), relative to the recipe file; needs `pip install "edgetune[torch]"`."""
    input_shapes: dict[ShortText, Shape] | None = Field(default=None, max_length=64)
    """Input name -> shape; needed when the ONNX file leaves dimensions symbolic. A zoo model has one
    input, `data`, of shape [N, 3, H, W]."""

    @field_validator("zoo")
    @classmethod
    def _known_zoo(cls, value: str | None) -> str | None:
        if value is not None and value not in ZOO_MODELS:
            raise ValueError(f"unknown zoo model {excerpt(repr(value))}; known: {', '.join(ZOO_MODELS)}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if [self.zoo, self.onnx, self.exported_program].count(None) != 2:
            raise ValueError("give exactly one of 'zoo' (a built-in model), 'onnx' (a file path) or "
                             "'exported_program' (a torch.export .pt2 file)")
        return self


def _check_host_port(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or len(value) > 260 or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected 'host:port' with a port from 1 to 65535, got {excerpt(repr(value))}")
    return value


HostPort = Annotated[str, AfterValidator(_check_host_port)]


class RpcSpec(_Strict):
    """Where to reach a remote device: an RPC tracker and the key the device registered with."""

    tracker: HostPort
    """host:port of the RPC tracker."""
    key: ShortText
    timeout_s: TimeoutSeconds = 30.0
    """Seconds one measurement may take on the device; a server that hangs costs this once."""

    @property
    def tracker_host(self) -> str:
        """Tracker host name or address."""
        return self.tracker.rpartition(":")[0]

    @property
    def tracker_port(self) -> int:
        """Tracker TCP port."""
        return int(self.tracker.rpartition(":")[2])


class SshSpec(_Strict):
    """A device edgetune provisions over SSH (`edgetune fleet up`): it starts the device's RPC server.

    Key or agent authentication only; the host key must be known (or `accept_new_host_key`).
    """

    host: ShortText
    user: ShortText
    port: int = Field(default=22, ge=1, le=65535)
    key_file: PathText | None = None
    """Private key, relative to the recipe file; without it, the SSH agent's keys and ~/.ssh/id_*."""
    known_hosts: PathText = "~/.ssh/known_hosts"
    accept_new_host_key: bool = False
    """OpenSSH's accept-new: trust and record an unknown host key; a changed one is still refused."""
    python: PathText = "python3"
    """The device's Python, with apache-tvm of the host's version installed."""
    workdir: PathText = ".edgetune/fleet"
    """Where the RPC server's pid file and log live on the device (relative to the login directory)."""
    tracker: HostPort | None = None
    """host:port of the tracker, as this machine reaches it; defaults to the recipe's `tracker`."""
    key: ShortText
    """The RPC key the device's server registers under."""
    timeout_s: TimeoutSeconds = 30.0
    """Seconds one measurement may take on the device; a server that hangs costs this once."""

    @model_validator(mode="before")
    @classmethod
    def _no_password(cls, data: Any) -> Any:
        if isinstance(data, dict) and "password" in data:
            raise ValueError(
                "a password cannot be given in a recipe: edgetune logs in with a key (key_file) or your SSH "
                "agent only; remove 'password'"
            )
        return data


class RpcConnection(_Strict):
    """`connection: {rpc: {...}}`: measured over TVM RPC; `{ssh: {...}}`: the same, after provisioning."""

    rpc: RpcSpec | None = None
    ssh: SshSpec | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> RpcConnection:
        if (self.rpc is None) == (self.ssh is None):
            raise ValueError("give exactly one of 'rpc' (a registered device) or 'ssh' (a device to provision)")
        return self

    @property
    def key(self) -> str:
        """The RPC key the device is measured under."""
        return (self.rpc or self.ssh).key  # type: ignore[union-attr]


class FleetTarget(_Strict):
    """One device in the fleet: a profile, optional overrides, and how to reach it."""

    name: Name
    profile: ShortText
    """A file device_profiles/<profile>.yaml."""
    overrides: dict[str, Any] | None = None
    """Deep-merged onto the profile (target, host, hardware, cross_compiler)."""
    connection: RpcConnection | None = None
    """None: measured on this machine (`connection: local` in YAML)."""
    transfer_from: list[ShortText] | None = Field(default=None, max_length=256)
    """Fleet targets whose tuning records warm-start this one (they are tuned first). Left out:
    the targets before it with the same ISA family and device kind; []: none."""

    @field_validator("connection", mode="before")
    @classmethod
    def _local(cls, value: Any) -> Any:
        if value == "local":
            return None
        if isinstance(value, str):
            raise ValueError(
                f"expected 'local' or {{rpc: {{tracker: 'host:port', key: ...}}}} or {{ssh: {{host: ..., user: ..., "
                f"key: ...}}}}, got {excerpt(repr(value))}"
            )
        return value

    @property
    def is_local(self) -> bool:
        """True when the device is this machine."""
        return self.connection is None


class TuningSpec(_Strict):
    """Search budget: trials per task and/or wall-clock minutes, whichever runs out first."""

    trials_per_task: Annotated[int, in_range(0, 100_000, "each trial is a measurement on the device; "
                                             "100000 per task is days of tuning")] | None = None
    """Measurements per task across builds; 0 compiles with whatever records the target's store holds."""
    time_budget_min: Annotated[YamlFloat, in_range(0, 10_080, "minutes: a week", low_open=True)] | None = None
    search: Literal["evolutionary", "draft-verify"] = "draft-verify"
    """draft-verify: edgetune's draft-then-verify search; evolutionary: MetaSchedule's stock one. Side by side
    on ResNet-18 (benchmarks/time_to_quality.py) draft-verify's artifact was 2x as fast at 5 and 10 minutes."""
    seed: Annotated[int, in_range(0, 2**32 - 1, "the random generators take 32-bit seeds")] = 0
    max_tasks: Annotated[int, in_range(1, 10_000, "a model has at most a few hundred tuning tasks")] | None = None
    """Tune only the N heaviest tasks."""
    winograd: bool = True
    """On CPU targets, 3x3 stride-1 convolutions computed by Winograd F(4x4, 3x3) on weights transformed
    at compile time (4x fewer multiplications; results differ from a direct convolution by float32
    rounding); false: direct convolution."""
    in_model_candidates: Annotated[int, in_range(1, 64, "each candidate is compiled and timed inside the "
                                                     "model")] = 4
    """On targets measured on this machine, each kernel's N best schedules are compared by their time
    inside the compiled model, where caches and neighbours differ from the tuner's lone kernel, and
    the fastest there is packaged (edgetune/selection.py); 1: the tuner's best."""
    transfer: Literal["momentum", "warm", "off"] = "momentum"
    """How a target learns from its siblings' records (fleet[].transfer_from): their best schedules
    are measured first and a model trained on their records predicts, adapted to the device's own
    measurements with momentum (MoA-Pruner) or by pooling them ("warm"); "off": never."""

    @model_validator(mode="after")
    def _has_budget(self) -> TuningSpec:
        if self.trials_per_task is None and self.time_budget_min is None:
            raise ValueError("give trials_per_task, time_budget_min, or both")
        return self


class VerifySpec(_Strict):
    """Tolerances for comparing the tuned module's output with the reference."""

    rtol: Annotated[YamlFloat, in_range(0, 1, "a relative tolerance above 1 (100 %) accepts almost any "
                                        "output")] = 1e-4
    atol: Annotated[YamlFloat, in_range(0, 1, "an absolute tolerance above 1 accepts almost any output of "
                                        "a network")] = 1e-4


class PackageSpec(_Strict):
    """What goes into each artifact beyond the library and its scripts."""

    bundle_runtime: bool = False
    """Ship TVM's runtime libraries for the device's architecture and a compiled C++ deploy program,
    so a board without pip (or Python) can run the model."""
    thread_wait: Literal["auto", "spin", "sleep"] = "auto"
    """How the artifact's CPU threads wait for work (TVM's spin count, set by `run.py` and `deploy`): "spin"
    (TVM's default) is fastest on a device that runs nothing else, "sleep" keeps the model's speed beside other
    busy processes; "auto", on a CPU measured on this machine, also builds edgetune's thread pool (a short spin
    that keeps the core, then sleep: thread_pool.py), times it and sleeping threads, idle and beside a
    low-priority busy process, and ships the way that loses least, the pool where they are within 5%
    (build/measure.py); it keeps TVM's default on the others."""


class TrackerSpec(_Strict):
    """The recipe's RPC tracker; with `start`, `edgetune fleet up` runs it on this machine."""

    host: Annotated[str, Field(max_length=255)] = "127.0.0.1"
    """Address it binds to (and is reached at); loopback unless devices must reach it directly."""
    port: int = Field(default=9190, ge=1, le=65535)
    start: bool = True

    @property
    def address(self) -> str:
        """host:port as this machine connects to it (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"{host}:{self.port}"


class Recipe(_Strict):
    """A validated recipe. Relative paths resolve against `base_dir` (the recipe's directory)."""

    name: Name
    model: ModelSpec
    fleet: list[FleetTarget] = Field(min_length=1, max_length=256)
    tuning: TuningSpec
    verify: VerifySpec = Field(default_factory=VerifySpec)
    package: PackageSpec = Field(default_factory=PackageSpec)
    tracker: TrackerSpec | None = None
    """The fleet's RPC tracker (see `edgetune fleet up`); the default tracker of `ssh` connections."""
    output: PathText = "build"
    """Output directory, relative to the recipe file (`~` is the home directory)."""
    records_dir: PathText | None = None
    """Where each device's tuning records persist across builds, relative to the recipe file
    (default: <output>/<name>/records); `edgetune build --records-dir` overrides it."""

    _source_path: Path | None = PrivateAttr(default=None)
    _base_dir: Path | None = PrivateAttr(default=None)

    @property
    def source_path(self) -> Path | None:
        """The recipe file, or None for a recipe given as text."""
        return self._source_path

    @property
    def base_dir(self) -> Path:
        """Directory relative paths resolve against (the working directory if never set)."""
        return self._base_dir or Path.cwd()

    @property
    def output_dir(self) -> Path:
        """Absolute output directory."""
        return (self.base_dir / Path(self.output).expanduser()).resolve()

    @property
    def records_path(self) -> Path:
        """Absolute directory of the record stores."""
        if self.records_dir is None:
            return self.output_dir / self.name / "records"
        return (self.base_dir / Path(self.records_dir).expanduser()).resolve()

    @property
    def model_path(self) -> Path | None:
        """Absolute path of the ONNX file; None for zoo models."""
        return (self.base_dir / self.model.onnx).resolve() if self.model.onnx else None

    @property
    def exported_program_path(self) -> Path | None:
        """Absolute path of the torch.export program; None unless the model is one."""
        program = self.model.exported_program
        return (self.base_dir / program).resolve() if program else None


def load_recipe(path: Path) -> Recipe:
    """Read and validate a recipe file; every problem is reported in one InputError."""
    path = Path(path)
    recipe = _load(read_yaml(path), path.parent)
    recipe._source_path = path.resolve()
    return recipe


def load_recipe_text(text: str, name: str = "<embedded>", base_dir: Path | None = None) -> Recipe:
    """Validate a recipe given as text (e.g. one embedded in the CLI); `name` appears in messages."""
    return _load(parse_yaml(text, name), Path(base_dir) if base_dir is not None else Path.cwd())


DEFAULT_RECIPE_NAME = "<default recipe: ResNet-18 for this machine>"


def load_default_recipe() -> Recipe:
    """The recipe `edgetune build` runs when given none (package data, so any install has it); its
    output is relative to the working directory."""
    text = (Path(__file__).resolve().parent / "default_recipe.yaml").read_text(encoding="utf-8")
    return load_recipe_text(text, DEFAULT_RECIPE_NAME, base_dir=Path.cwd())


def recipe_hash(recipe: Recipe) -> str:
    """sha256 of the validated recipe as canonical JSON: same for any key order or spelled-out defaults."""
    canonical = json.dumps(recipe.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _load(doc: YamlDocument, base_dir: Path) -> Recipe:
    recipe, problems = validate(Recipe, doc.data)
    problems += _model_file_problems(doc.data, base_dir) + _output_problems(doc.data, base_dir)
    problems += _fleet_problems(doc.data) + _tracker_problems(doc.data)
    if problems or recipe is None:
        raise InputError(doc.locate(problems))
    # Profiles are checked against TVM itself, which takes seconds to import: only once all else is right.
    problems, outside = _profile_problems(doc.data)
    if problems or outside:
        raise InputError(doc.locate(problems) + outside)
    recipe._base_dir = base_dir.resolve()
    return recipe


def _usable_path(value: object) -> bool:
    """True for a path the schema accepts (its own problems are reported there)."""
    return isinstance(value, str) and 0 < len(value) <= 4096 and "\0" not in value


def _model_file_problems(data: dict[str, Any], base_dir: Path) -> list[Problem]:
    """What `build` would otherwise find late: an ONNX file it cannot use, input shapes the model lacks."""
    model = data.get("model")
    if not isinstance(model, dict):
        return []
    onnx, shapes = model.get("onnx"), model.get("input_shapes")
    shapes = shapes if isinstance(shapes, dict) else {}
    program = model.get("exported_program")
    if _usable_path(program) and not (base_dir / program).is_file():
        shown = excerpt(display_path(base_dir / program), 200)
        return [Problem(("model", "exported_program"), f"torch.export program (a file written by torch.export.save) "
                                                       f"not found: {shown}")]
    if isinstance(model.get("zoo"), str) and onnx is None:
        return _zoo_shape_problems(shapes)
    if not _usable_path(onnx):
        return []
    path = base_dir / onnx
    if not path.exists():
        return [Problem(("model", "onnx"), f"ONNX file not found: {excerpt(display_path(path), 200)}")]
    if not path.is_file():
        return [Problem(("model", "onnx"), f"{excerpt(display_path(path), 200)}: not a file; expected an ONNX model")]
    return _onnx_problems(path, shapes)


def _zoo_shape_problems(shapes: dict[Any, Any]) -> list[Problem]:
    """A zoo model has one input, `data`, shaped [N, 3, H, W] (edgetune.frontend.zoo)."""
    problems = []
    for name, shape in shapes.items():
        where = ("model", "input_shapes", name)
        if name != ZOO_INPUT:
            problems.append(Problem(where, f"a zoo model has one input, '{ZOO_INPUT}'; no input named "
                                           f"{excerpt(repr(name))}", at_key=True))
        elif isinstance(shape, list) and (len(shape) != 4 or shape[1] != 3):
            problems.append(Problem(where, f"expected [N, 3, H, W] for a zoo model (batch, 3 colour channels, "
                                           f"height, width), got {excerpt(shape)}"))
    return problems


_ONNX_ELEMENT_TYPES = {1: "float32", 2: "uint8", 3: "int8", 6: "int32", 7: "int64", 10: "float16", 11: "float64"}
"""ONNX TensorProto element types an input may have (those edgetune.frontend.onnx can feed)."""

MAX_ONNX_BYTES = 2**31 - 1
"""Protocol buffers cannot hold more; larger models keep their weights in external data files."""


def _onnx_problems(path: Path, shapes: dict[Any, Any]) -> list[Problem]:
    """Parse the model's protocol buffer (no TVM import, no external weights) and check its signature."""
    where, shown = ("model", "onnx"), excerpt(display_path(path), 200)
    if path.stat().st_size > MAX_ONNX_BYTES:
        return [Problem(where, f"{shown}: larger than 2 GiB; ONNX keeps weights this large in external data files")]
    try:
        import onnx

        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, OSError, onnx's own errors: all say "cannot use it"
        return [Problem(where, f"{shown}: not a readable ONNX model ({excerpt(exc, 160)})")]
    if not proto.graph.node or not proto.graph.output:
        return [Problem(where, f"{shown}: not an ONNX model, or a truncated one: its graph has no "
                               f"{'nodes' if not proto.graph.node else 'outputs'}")]
    if not any(opset.domain in ("", "ai.onnx") and opset.version > 0 for opset in proto.opset_import):
        return [Problem(where, f"{shown}: declares no ONNX operator set version (opset_import); export it again "
                               "with an opset (e.g. torch.onnx.export(..., opset_version=17))")]
    return _name_problems(shown, proto) + _input_problems(shown, proto, shapes)


def _name_problems(shown: str, proto: Any) -> list[Problem]:
    """Input and output names travel as data (npz entries, io.json); an npz entry's name ends at a NUL byte."""
    return [Problem(("model", "onnx"), f"{shown}: {kind} name {excerpt(ascii(value.name))} contains a NUL byte, "
                                       "which no file format the artifact uses can carry; rename it")
            for kind, values in (("input", proto.graph.input), ("output", proto.graph.output))
            for value in values if "\0" in value.name]


def _input_problems(shown: str, proto: Any, shapes: dict[Any, Any]) -> list[Problem]:
    """input_shapes against the graph's inputs: each named one exists with that rank, and every input
    the recipe leaves out has a concrete shape and an element type edgetune can feed."""
    initializers = {t.name for t in proto.graph.initializer}
    inputs = {i.name: i for i in proto.graph.input if i.name not in initializers}
    problems = [Problem(("model", "input_shapes", name), f"{shown} has no input {excerpt(repr(name))}; its inputs "
                                                         f"are {excerpt(sorted(inputs), 200)}", at_key=True)
                for name in shapes if name not in inputs]
    for name, value in inputs.items():
        tensor_type, shown_name = value.type.tensor_type, excerpt(repr(name))
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        if tensor_type.elem_type not in _ONNX_ELEMENT_TYPES:
            problems.append(Problem(("model", "onnx"), f"{shown}: input {shown_name} has element type "
                                                       f"{tensor_type.elem_type}; supported: "
                                                       f"{', '.join(_ONNX_ELEMENT_TYPES.values())}"))
        elif isinstance(shapes.get(name), list) and dims and len(shapes[name]) != len(dims):
            problems.append(Problem(("model", "input_shapes", name),
                                    f"{shown}: input {shown_name} has {len(dims)} dimensions, got {len(shapes[name])}"))
        elif name not in shapes and any(d is None or d <= 0 for d in dims):
            problems.append(Problem(("model", "onnx"), f"{shown}: input {shown_name} has a dynamic shape "
                                                       f"{excerpt(dims)}; give it in model.input_shapes, e.g. "
                                                       f"{{{excerpt(name)}: [1, 3, 224, 224]}}"))
    return problems


def _output_problems(data: dict[str, Any], base_dir: Path) -> list[Problem]:
    """Where the build would write: refuse places edgetune must not write into, before anything is written."""
    problems = []
    output, name, records = data.get("output", "build"), data.get("name"), data.get("records_dir")
    if _usable_path(output):
        output_dir = _absolute(base_dir, output)
        if isinstance(output_dir, str):
            problem: str | None = output_dir
        else:
            problem = _output_dir_problem(output_dir)
            if problem is None and isinstance(name, str) and _NAME.fullmatch(name):
                problem = _build_dir_problem(output_dir / name, data)
        if problem:
            problems.append(Problem(("output",), problem))
    if _usable_path(records):
        records_dir = _absolute(base_dir, records)
        problem = records_dir if isinstance(records_dir, str) else _writable_problem(records_dir)
        if problem:
            problems.append(Problem(("records_dir",), problem))
    return problems


def _build_dir_problem(build_dir: Path, data: dict[str, Any]) -> str | None:
    """What the build claims before writing (package.artifact.claim_build_directory): <output>/<name>/ and
    each target's artifact directory in it must be absent, empty or edgetune's."""
    targets = [entry.get("name") for _, entry in _fleet_entries(data)]
    directories = [build_dir, *(build_dir / t for t in targets if isinstance(t, str) and _NAME.fullmatch(t))]
    return next((p for p in map(foreign_directory_problem, directories) if p), None)


def _absolute(base_dir: Path, value: str) -> Path | str:
    """The absolute directory `value` names, or why it names none (`~nobody`: no such user)."""
    try:
        path = base_dir / Path(value).expanduser()
    except RuntimeError as exc:
        return f"cannot expand {excerpt(repr(value))}: {excerpt(exc)}"
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symbolic link loop: judged as written
        return path.absolute()


def _output_dir_problem(directory: Path) -> str | None:
    """The root and the home directory hold what the user did not give edgetune."""
    if directory == Path(directory.anchor):
        return f"{directory}: is the file system root; give a directory of edgetune's own, e.g. 'build'"
    if directory == Path.home().resolve():
        return f"{directory}: is your home directory; give a directory of edgetune's own, e.g. '~/edgetune-builds'"
    return _writable_problem(directory)


def _writable_problem(directory: Path) -> str | None:
    """Why edgetune could not create or write into `directory`, or None."""
    if directory.exists() and not directory.is_dir():
        return f"{excerpt(directory, 200)}: exists and is not a directory; expected a directory (or a new name)"
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        return f"{excerpt(directory, 200)}: cannot be created: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{excerpt(directory, 200)}: cannot be created or written: {existing} is not writable by you"
    return None


def _fleet_problems(data: dict[str, Any]) -> list[Problem]:
    """Unique names, transfer_from references, known profile names, overrides on their own (no TVM needed).

    Works on raw data, skipping values of the wrong type (the schema already reports those).
    """
    entries = _fleet_entries(data)
    problems = []
    first_index: dict[str, int] = {}
    for i, entry in entries:
        name = entry.get("name")
        if isinstance(name, str):
            if name in first_index:
                problems.append(Problem(("fleet", i, "name"), f"duplicate target name '{excerpt(name)}' "
                                                              f"(also fleet[{first_index[name]}])"))
            else:
                first_index[name] = i
    known_profiles = profiles.profile_names()
    for i, entry in entries:
        sources = entry.get("transfer_from")
        for j, source in enumerate(sources if isinstance(sources, list) else []):
            if source == entry.get("name"):
                problems.append(Problem(("fleet", i, "transfer_from", j), "a target cannot transfer from itself"))
            elif isinstance(source, str) and source not in first_index:
                targets = excerpt(", ".join(first_index), 200)
                problems.append(Problem(("fleet", i, "transfer_from", j),
                                        f"no fleet target named '{excerpt(source)}'; targets: {targets}"))
        profile, overrides = entry.get("profile"), entry.get("overrides")
        if isinstance(profile, str) and profile not in known_profiles:
            problems.append(Problem(("fleet", i, "profile"),
                                    profiles.unknown_profile_message(excerpt(profile), known_profiles)))
        if isinstance(overrides, dict):
            problems += [Problem(("fleet", i, "overrides", *p.path), p.message, p.at_key)
                         for p in profiles.override_problems(overrides)]
    return problems + _transfer_cycle_problems(entries)


def _fleet_entries(data: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    fleet = data.get("fleet")
    return [(i, entry) for i, entry in enumerate(fleet) if isinstance(entry, dict)] if isinstance(fleet, list) else []


def _profile_problems(data: dict[str, Any]) -> tuple[list[Problem], list[str]]:
    """Each target's profile with its overrides, checked as a whole (against TVM too).

    Returns problems in the recipe, and problems already located in a broken profile file.
    """
    problems: list[Problem] = []
    outside: list[str] = []
    for i, entry in _fleet_entries(data):
        overrides = entry.get("overrides")
        try:
            profiles.resolve_profile(entry["profile"], overrides if isinstance(overrides, dict) else None)
        except InvalidData as exc:
            problems += [Problem(("fleet", i, "overrides", *p.path), p.message, p.at_key) for p in exc.found]
        except InputError as exc:
            outside += [p for p in exc.problems if p not in outside]
    return problems, outside


def _transfer_cycle_problems(entries: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    """Siblings tune first, so transfer_from cannot go round in a circle.

    Tarjan's strongly connected components, without recursion: linear in the fleet's size.
    """
    sources: dict[str, list[str]] = {}
    index: dict[str, int] = {}
    for i, entry in entries:
        name, named = entry.get("name"), entry.get("transfer_from")
        if isinstance(name, str) and name not in index:
            index[name] = i
            sources[name] = [s for s in named if isinstance(s, str) and s != name] if isinstance(named, list) else []
    in_circle = [name for component in _components(sources) if len(component) > 1 for name in component]
    return [Problem(("fleet", index[name], "transfer_from"),
                    f"'{excerpt(name)}' transfers from itself through its sources' transfer_from "
                    "(a circle): one of them must tune first")
            for name in sorted(in_circle, key=index.__getitem__)]


def _components(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of `graph` (edges to unknown names are ignored)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    edges_of = {node: [e for e in edges if e in graph] for node, edges in graph.items()}
    for start in graph:
        if start in order:
            continue
        work = [(start, 0)]
        while work:
            node, next_edge = work.pop()
            if next_edge == 0:
                order[node] = low[node] = len(order)
                stack.append(node)
                on_stack.add(node)
            edges = edges_of[node]
            if next_edge < len(edges):
                work.append((node, next_edge + 1))
                child = edges[next_edge]
                if child not in order:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], order[child])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == order[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(component)
    return found


def _tracker_problems(data: dict[str, Any]) -> list[Problem]:
    """An `ssh` connection needs a tracker: its own, or the recipe's."""
    if isinstance(data.get("tracker"), dict):
        return []
    fleet = data.get("fleet")
    problems = []
    for i, entry in enumerate(fleet if isinstance(fleet, list) else []):
        connection = entry.get("connection") if isinstance(entry, dict) else None
        ssh = connection.get("ssh") if isinstance(connection, dict) else None
        if isinstance(ssh, dict) and "tracker" not in ssh:
            problems.append(Problem(
                ("fleet", i, "connection", "ssh", "tracker"),
                "no tracker: give 'tracker: host:port' here, or a recipe-level 'tracker:' section",
            ))
    return problems
