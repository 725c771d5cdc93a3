"""The recipe: which model to tune, for which fleet of devices, with what budget.

`load_recipe` reports every problem in one InputError, each located in the recipe file
("recipes/x.yaml:7: fleet[1].profile: ..."). Structure is checked by the pydantic models; what
depends on the world outside the file (device profiles, the ONNX file, other fleet entries) is
checked against the raw data, so those problems are reported even when the structure is broken.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from edgetune import profiles
from edgetune.errors import InputError
from edgetune.yamlsource import (
    InvalidData,
    Problem,
    YamlDocument,
    YamlFloat,
    display_path,
    parse_yaml,
    read_yaml,
    validate,
)

ZOO_MODELS = ("resnet18", "mobilenet_v2", "tiny_cnn")
"""Built-in models (mirrors edgetune.frontend.zoo.ZOO_NAMES without importing the frontend)."""

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*")


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(
            f"expected lowercase letters, digits, '-' or '_', starting with a letter or digit "
            f"(it names a directory), got {value!r}"
        )
    return value


Name = Annotated[str, AfterValidator(_check_name)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSpec(_Strict):
    """The network: a built-in zoo model or an ONNX file (exactly one)."""

    zoo: str | None = None
    onnx: str | None = None
    """Path relative to the recipe file."""
    input_shapes: dict[str, list[PositiveInt]] | None = None
    """Input name -> shape; needed when the ONNX file leaves dimensions symbolic."""

    @field_validator("zoo")
    @classmethod
    def _known_zoo(cls, value: str | None) -> str | None:
        if value is not None and value not in ZOO_MODELS:
            raise ValueError(f"unknown zoo model {value!r}; known: {', '.join(ZOO_MODELS)}")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.zoo is None) == (self.onnx is None):
            raise ValueError("give exactly one of 'zoo' (a built-in model) or 'onnx' (a file path)")
        return self


def _check_host_port(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"expected 'host:port' with a port from 1 to 65535, got {value!r}")
    return value


HostPort = Annotated[str, AfterValidator(_check_host_port)]


class RpcSpec(_Strict):
    """Where to reach a remote device: an RPC tracker and the key the device registered with."""

    tracker: HostPort
    """host:port of the RPC tracker."""
    key: str = Field(min_length=1)
    timeout_s: YamlFloat = Field(default=30.0, gt=0)
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

    host: str = Field(min_length=1)
    user: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    key_file: str | None = None
    """Private key, relative to the recipe file; without it, the SSH agent's keys and ~/.ssh/id_*."""
    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_key: bool = False
    """OpenSSH's accept-new: trust and record an unknown host key; a changed one is still refused."""
    python: str = "python3"
    """The device's Python, with apache-tvm of the host's version installed."""
    workdir: str = ".edgetune/fleet"
    """Where the RPC server's pid file and log live on the device (relative to the login directory)."""
    tracker: HostPort | None = None
    """host:port of the tracker, as this machine reaches it; defaults to the recipe's `tracker`."""
    key: str = Field(min_length=1)
    """The RPC key the device's server registers under."""
    timeout_s: YamlFloat = Field(default=30.0, gt=0)
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
    profile: str
    """A file device_profiles/<profile>.yaml."""
    overrides: dict[str, Any] | None = None
    """Deep-merged onto the profile (target, host, hardware, cross_compiler)."""
    connection: RpcConnection | None = None
    """None: measured on this machine (`connection: local` in YAML)."""
    transfer_from: list[str] | None = None
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
                f"key: ...}}}}, got {value!r}"
            )
        return value

    @property
    def is_local(self) -> bool:
        """True when the device is this machine."""
        return self.connection is None


class TuningSpec(_Strict):
    """Search budget: trials per task and/or wall-clock minutes, whichever runs out first."""

    trials_per_task: NonNegativeInt | None = None
    """Measurements per task across builds; 0 compiles with whatever records the target's store holds."""
    time_budget_min: YamlFloat | None = Field(default=None, gt=0)
    search: Literal["evolutionary", "draft-verify"] = "evolutionary"
    seed: NonNegativeInt = 0
    max_tasks: PositiveInt | None = None
    """Tune only the N heaviest tasks."""
    winograd: bool = True
    """On CPU targets, 3x3 stride-1 convolutions computed by Winograd F(4x4, 3x3) on weights transformed
    at compile time (4x fewer multiplications; results differ from a direct convolution by float32
    rounding); false: direct convolution."""
    in_model_candidates: PositiveInt = 4
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

    rtol: YamlFloat = Field(default=1e-4, ge=0)
    atol: YamlFloat = Field(default=1e-4, ge=0)


class PackageSpec(_Strict):
    """What goes into each artifact beyond the library and its scripts."""

    bundle_runtime: bool = False
    """Ship TVM's runtime libraries for the device's architecture and a compiled C++ deploy program,
    so a board without pip (or Python) can run the model."""


class TrackerSpec(_Strict):
    """The recipe's RPC tracker; with `start`, `edgetune fleet up` runs it on this machine."""

    host: str = "127.0.0.1"
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
    fleet: list[FleetTarget] = Field(min_length=1)
    tuning: TuningSpec
    verify: VerifySpec = Field(default_factory=VerifySpec)
    package: PackageSpec = Field(default_factory=PackageSpec)
    tracker: TrackerSpec | None = None
    """The fleet's RPC tracker (see `edgetune fleet up`); the default tracker of `ssh` connections."""
    output: str = "build"
    """Output directory, relative to the recipe file."""
    records_dir: str | None = None
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
        return (self.base_dir / self.output).resolve()

    @property
    def records_path(self) -> Path:
        """Absolute directory of the record stores."""
        if self.records_dir is None:
            return self.output_dir / self.name / "records"
        return (self.base_dir / self.records_dir).resolve()

    @property
    def model_path(self) -> Path | None:
        """Absolute path of the ONNX file; None for zoo models."""
        return (self.base_dir / self.model.onnx).resolve() if self.model.onnx else None


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
    problems += _model_file_problems(doc.data, base_dir)
    fleet_problems, outside = _fleet_problems(doc.data)
    problems += fleet_problems + _tracker_problems(doc.data)
    if problems or outside or recipe is None:
        raise InputError(doc.locate(problems) + outside)
    recipe._base_dir = base_dir.resolve()
    return recipe


def _model_file_problems(data: dict[str, Any], base_dir: Path) -> list[Problem]:
    model = data.get("model")
    onnx = model.get("onnx") if isinstance(model, dict) else None
    if isinstance(onnx, str) and not (base_dir / onnx).is_file():
        return [Problem(("model", "onnx"), f"ONNX file not found: {display_path(base_dir / onnx)}")]
    return []


def _fleet_problems(data: dict[str, Any]) -> tuple[list[Problem], list[str]]:
    """Unique names, transfer_from references, known profiles and valid overrides.

    Works on raw data, skipping values of the wrong type (the schema already reports those).
    Returns problems in the recipe, and problems already located in a broken profile file.
    """
    fleet = data.get("fleet")
    if not isinstance(fleet, list):
        return [], []
    entries = [(i, entry) for i, entry in enumerate(fleet) if isinstance(entry, dict)]
    problems = []
    outside: list[str] = []
    first_index: dict[str, int] = {}
    for i, entry in entries:
        name = entry.get("name")
        if isinstance(name, str):
            if name in first_index:
                problems.append(
                    Problem(("fleet", i, "name"), f"duplicate target name '{name}' (also fleet[{first_index[name]}])")
                )
            else:
                first_index[name] = i
    known_profiles = profiles.profile_names()
    for i, entry in entries:
        sources = entry.get("transfer_from")
        for j, source in enumerate(sources if isinstance(sources, list) else []):
            if source == entry.get("name"):
                problems.append(Problem(("fleet", i, "transfer_from", j), "a target cannot transfer from itself"))
            elif isinstance(source, str) and source not in first_index:
                targets = ", ".join(first_index)
                problems.append(
                    Problem(("fleet", i, "transfer_from", j), f"no fleet target named '{source}'; targets: {targets}")
                )
        profile = entry.get("profile")
        if not isinstance(profile, str):
            continue
        if profile not in known_profiles:
            problems.append(Problem(("fleet", i, "profile"), profiles.unknown_profile_message(profile, known_profiles)))
            continue
        overrides = entry.get("overrides")
        try:
            profiles.resolve_profile(profile, overrides if isinstance(overrides, dict) else None)
        except InvalidData as exc:
            problems += [Problem(("fleet", i, "overrides", *p.path), p.message, p.at_key) for p in exc.found]
        except InputError as exc:
            outside += [p for p in exc.problems if p not in outside]
    return problems + _transfer_cycle_problems(entries), outside


def _transfer_cycle_problems(entries: list[tuple[int, dict[str, Any]]]) -> list[Problem]:
    """Siblings tune first, so transfer_from cannot go round in a circle."""
    sources: dict[str, list[str]] = {}
    index: dict[str, int] = {}
    for i, entry in entries:
        name, named = entry.get("name"), entry.get("transfer_from")
        if isinstance(name, str) and name not in index:
            index[name] = i
            sources[name] = [s for s in named if isinstance(s, str)] if isinstance(named, list) else []
    problems = []
    for name, direct in sources.items():
        frontier, seen = list(direct), set()
        while frontier:
            current = frontier.pop()
            if current == name and name not in direct:
                problems.append(Problem(("fleet", index[name], "transfer_from"),
                                        f"'{name}' transfers from itself through its sources' transfer_from "
                                        "(a circle): one of them must tune first"))
                break
            if current not in seen:
                seen.add(current)
                frontier.extend(sources.get(current, []))
    return problems


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
