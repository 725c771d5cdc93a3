"""Device profiles: what TVM compiles for (target) and the numbers the analytic cost model needs.

Profiles live in device_profiles/<name>.yaml. A fleet target in a recipe names one and may
override parts of it; `resolve_profile` deep-merges those overrides and validates the result
again, including against TVM itself, because TVM silently accepts an mcpu LLVM does not know.
The `host` profile has `detect: true`: what it leaves out is measured on this machine.
"""

from __future__ import annotations

import difflib
import functools
import os
import platform
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, create_model, model_validator

from edgetune.errors import InputError
from edgetune.yamlsource import InvalidData, Problem, YamlFloat, excerpt, in_range, read_yaml, unknown_field, validate

if TYPE_CHECKING:
    import tvm.target

PROFILES_DIR = Path(__file__).resolve().parent / "device_profiles"
"""Package data, so a non-editable install (a wheel) knows every profile; the repository's
`device_profiles/` is a link to it."""

OVERRIDABLE = ("target", "host", "hardware", "cross_compiler")
"""Top-level profile fields a fleet target may override."""

DEFAULT_CLOCK_GHZ = 2.0
"""Host clock assumed when neither cpufreq nor /proc/cpuinfo report one."""

FP_PIPES = 2
"""SIMD FP pipes per core assumed by host detection (Skylake+, Zen, Cortex-A7x class cores)."""

HALF_RATE_AVX512_CPUS = ("znver4",)
"""CPUs (LLVM's names) that run AVX-512 on 256-bit pipes: as many flops a cycle as AVX2. Counted at 512 bits,
a Zen 4 VM's profile read 332 GFLOPS where 233 were measured, and the Winograd policy, which weighs flops
against memory bytes, gave ResNet-18's last stage the direct convolution: about 10% slower a model (README).
The count moves the peak alone: the analyzer keeps two pipes (`vector_pipes`)."""

Isa = Literal["x86_64", "aarch64", "armv7", "cuda", "opencl"]
RuntimeDevice = Literal["cpu", "cuda", "opencl"]

_TARGET_KIND: dict[str, str] = {"cpu": "llvm", "cuda": "cuda", "opencl": "opencl"}
_DEVICE_ISAS: dict[str, tuple[str, ...]] = {
    "cpu": ("x86_64", "aarch64", "armv7"),
    "cuda": ("cuda",),
    "opencl": ("opencl",),
}
_REQUIRED_HARDWARE: dict[str, tuple[str, ...]] = {
    "cpu": ("cores", "vector_bits"),
    "cuda": ("sm_count", "max_threads_per_block", "shared_memory_per_block_kb", "warp_size"),
    "opencl": ("sm_count", "max_threads_per_block", "shared_memory_per_block_kb", "warp_size"),
}
_CUDA_ARCH = re.compile(r"sm_\d+[a-z]?")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


_Units = Annotated[int, in_range(1, 1024, "compute units one device runs kernels on; threads and the cost "
                                          "model are sized by it")]
_CacheKb = Annotated[int, in_range(0, 2**21, "KiB; no device has a 2 GiB cache")]


class Hardware(_Strict):
    """Numbers the analytic cost model needs about the device that runs the kernels.

    Each has a range: they size thread pools and the cost model's arithmetic, and a typo (1000000
    cores) would otherwise surface as a hang or a nonsense estimate long after validation.
    """

    cores: _Units | None = None
    """CPU cores used for compute (CPU profiles)."""
    clock_ghz: Annotated[YamlFloat, in_range(0, 10, "GHz; no processor runs above 10 GHz", low_open=True)]
    """Clock of the compute device (the GPU clock for GPU profiles)."""
    flops_per_cycle: Annotated[YamlFloat, in_range(0, 4096, "fp32 FLOPs per cycle of one core or SM",
                                                   low_open=True)]
    """Peak fp32 FLOPs per cycle per CPU core, or per SM / shader core on GPUs (an FMA counts 2)."""
    vector_bits: Annotated[int, in_range(32, 2048, "SIMD register width in bits; SVE tops out at 2048")] | None = None
    """SIMD register width (CPU profiles)."""
    vector_pipes: Annotated[int, in_range(1, 16, "SIMD FP pipes of one core; today's cores have 1 to 4")] | None = None
    """SIMD FP pipes of one CPU core, as the analyzer counts them: one full-width vector operation each a
    cycle. Left out: flops_per_cycle / (2 * lanes). Host detection gives it, since a CPU that runs its widest
    vectors on narrower pipes has fewer flops a cycle than pipes x lanes x 2, and the analyzer's drafts ranked
    worse when it counted the pipes from the flops (README, "How far the goals are from this machine's floor")."""
    l1d_kb: _CacheKb
    """L1 data cache per core, or L1/shared per SM on GPUs."""
    l2_kb: _CacheKb
    l3_kb: _CacheKb = 0
    memory_bandwidth_gbs: Annotated[YamlFloat, in_range(0, 100_000, "GB/s; the fastest memories give a few "
                                                        "thousand", low_open=True)]
    """Datasheet peak DRAM bandwidth."""
    peak_gflops: Annotated[YamlFloat, in_range(0, 10_000_000, "GFLOPS; 10 PFLOPS is beyond any one device",
                                               low_open=True)] | None = None
    """Peak fp32 GFLOPS; computed as (sm_count or cores) * clock_ghz * flops_per_cycle when omitted."""
    sm_count: _Units | None = None
    """GPU streaming multiprocessors / shader cores."""
    max_threads_per_block: Annotated[int, in_range(1, 4096, "GPU threads in one block")] | None = None
    shared_memory_per_block_kb: Annotated[int, in_range(1, 1024, "KiB of GPU shared memory")] | None = None
    registers_per_sm: Annotated[int, in_range(1, 2**20, "registers of one SM")] | None = None
    warp_size: Annotated[int, in_range(1, 128, "threads that run in lockstep")] | None = None

    @model_validator(mode="after")
    def _fill_peak(self) -> Hardware:
        if self.peak_gflops is None:
            units = self.sm_count if self.sm_count is not None else self.cores
            if units is None:
                raise ValueError("give peak_gflops, or cores / sm_count so it can be computed")
            self.peak_gflops = round(units * self.clock_ghz * self.flops_per_cycle, 1)
        return self

    @property
    def compute_units(self) -> int:
        """Units that run in parallel: SMs on GPUs, cores on CPUs."""
        units = self.sm_count if self.sm_count is not None else self.cores
        assert units is not None  # guaranteed by profile validation
        return units


class DeviceProfile(_Strict):
    """One kind of device: TVM target, runtime device, toolchain and hardware numbers."""

    name: str
    description: str
    detect: bool = False
    """Fill what the file leaves out by measuring this machine (the `host` profile)."""
    isa: Isa
    """ISA family; targets of the same family can share tuning records."""
    device: RuntimeDevice
    """Runtime device the compiled module runs on."""
    target: dict[str, Any]
    """TVM target in dict form, e.g. {kind: llvm, mtriple: ..., mcpu: ..., num-cores: 4}."""
    host: dict[str, Any] | None = None
    """Host part for GPU targets, e.g. {kind: llvm, mtriple: aarch64-linux-gnu}."""
    cross_compiler: str | None = None
    """Compiler for the exported library; null means this machine's native compiler."""
    hardware: Hardware

    def tvm_target(self) -> tvm.target.Target:
        """The TVM target, with its host part when the profile has one."""
        from tvm.target import Target

        return Target(self.target, host=self.host) if self.host else Target(self.target)

    @property
    def cpu_threads(self) -> int | None:
        """Threads TVM's runtime runs kernels on, for CPU devices: the profile's cores (required there)."""
        return self.hardware.cores if self.device == "cpu" else None

    @property
    def is_native(self) -> bool:
        """True when this machine's own compiler builds for it (no cross compiler, same ISA)."""
        if self.cross_compiler is not None:
            return False
        if self.device == "cpu":
            return self.isa == machine_isa()
        host_triple = (self.host or {}).get("mtriple")
        return host_triple is None or _triple_isa(host_triple) == machine_isa()


def machine_isa() -> str:
    """ISA family of this machine, in profile terms."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64", "armv7l": "armv7"}.get(machine, machine)


def _triple_isa(triple: str) -> str | None:
    for prefix, isa in (("x86_64", "x86_64"), ("aarch64", "aarch64"), ("arm64", "aarch64"), ("arm", "armv7")):
        if triple.startswith(prefix):
            return isa
    return None


def profile_names(directory: Path = PROFILES_DIR) -> list[str]:
    """Names of the shipped profiles (file stems), without loading them."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def unknown_profile_message(name: str, known: list[str]) -> str:
    """Message for a profile name that has no file, with a suggestion when one is close."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown device profile '{name}'; {hint}known: {', '.join(known)}"


def load_profile(name: str, directory: Path = PROFILES_DIR) -> DeviceProfile:
    """Load and fully check device_profiles/<name>.yaml (host: detected on this machine)."""
    return _load(name, directory)[1]


def list_profiles(directory: Path = PROFILES_DIR) -> list[DeviceProfile]:
    """Every shipped profile, loaded and checked, in name order."""
    return [load_profile(name, directory) for name in profile_names(directory)]


def resolve_profile(
    name: str, overrides: Mapping[str, Any] | None = None, directory: Path = PROFILES_DIR
) -> DeviceProfile:
    """The profile with a fleet target's overrides deep-merged in, checked again as a whole.

    Problems with the overrides raise InvalidData (paths under "overrides", so a recipe can
    point at its own lines); a broken profile file raises InputError located in that file.
    """
    raw, profile = _load(name, directory)
    if not overrides:
        return profile
    problems = [
        Problem((key,), unknown_field(key, OVERRIDABLE), at_key=True) for key in overrides if key not in OVERRIDABLE
    ]
    known = {key: value for key, value in overrides.items() if key in OVERRIDABLE}
    merged, merge_problems = _check(_merge(raw, known))
    problems += merge_problems
    if problems or merged is None:
        raise InvalidData(problems, prefix=("overrides",))
    return merged


def _load(name: str, directory: Path) -> tuple[dict[str, Any], DeviceProfile]:
    """The profile file's data (detected values filled in) and the checked profile."""
    known = profile_names(directory)
    if name not in known:
        raise InputError(unknown_profile_message(name, known))
    doc = read_yaml(directory / f"{name}.yaml")
    raw: dict[str, Any] = doc.data
    if raw.get("detect") is True:
        raw = _merge(detect_host(), raw)
    profile, problems = _check(raw)
    if raw.get("name") != name:
        problems.append(Problem(("name",), f"must match the file name '{name}'"))
    if problems or profile is None:
        raise InputError(doc.locate(problems))
    return raw, profile


def _merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else (lists included) is replaced."""
    merged = dict(base)
    for key, value in update.items():
        old = merged.get(key)
        merged[key] = _merge(old, value) if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return merged


def _check(raw: Any) -> tuple[DeviceProfile | None, list[Problem]]:
    """Schema, then consistency between fields, then what TVM/LLVM accept."""
    profile, problems = validate(DeviceProfile, raw)
    if profile is None:
        return None, problems
    problems = _consistency_problems(profile) or _tvm_problems(profile)
    return (None if problems else profile), problems


def _consistency_problems(p: DeviceProfile) -> list[Problem]:
    problems = []
    if p.isa not in _DEVICE_ISAS[p.device]:
        expected = " or ".join(f"'{i}'" for i in _DEVICE_ISAS[p.device])
        problems.append(Problem(("isa",), f"expected {expected} for device '{p.device}', got '{p.isa}'"))
    for field, spec, kind in (("target", p.target, _TARGET_KIND[p.device]), ("host", p.host, "llvm")):
        if spec is None:
            continue
        if "kind" not in spec:
            problems.append(Problem((field, "kind"), "required field is missing"))
        elif spec["kind"] != kind:
            problems.append(
                Problem((field, "kind"),
                        f"expected '{kind}' for device '{p.device}', got {excerpt(repr(spec['kind']))}")
            )
    problems += _num_cores_problems(p.target)
    triple = p.target.get("mtriple")
    if p.device == "cpu" and isinstance(triple, str) and _triple_isa(triple) not in (None, p.isa):
        problems.append(Problem(("target", "mtriple"), f"'{triple}' is not an {p.isa} triple (isa is '{p.isa}')"))
    for field in _REQUIRED_HARDWARE[p.device]:
        if getattr(p.hardware, field) is None:
            problems.append(Problem(("hardware", field), f"required for a '{p.device}' profile"))
    return problems


def _num_cores_problems(target: Mapping[str, Any]) -> list[Problem]:
    cores = target.get("num-cores")
    if isinstance(cores, int) and not isinstance(cores, bool) and not 1 <= cores <= 1024:
        return [Problem(("target", "num-cores"), f"must be at least 1 and at most 1024 (threads TVM compiles "
                                                 f"for), got {excerpt(cores)}")]
    return []


def override_problems(overrides: Mapping[str, Any]) -> list[Problem]:
    """What a fleet target's overrides show on their own: unknown sections, each hardware number's type
    and range, the thread count. Needs neither TVM (seconds to import) nor the profile, so a recipe
    check reports these with its other problems; `resolve_profile` then checks the merged whole."""
    problems = [Problem((key,), unknown_field(key, OVERRIDABLE), at_key=True) for key in overrides
                if key not in OVERRIDABLE]
    target, hardware = overrides.get("target"), overrides.get("hardware")
    if isinstance(target, Mapping):
        problems += _num_cores_problems(target)
    for key, value in hardware.items() if isinstance(hardware, Mapping) else ():
        if key not in Hardware.model_fields:
            problems.append(Problem(("hardware", key), unknown_field(key, Hardware.model_fields), at_key=True))
            continue
        _, found = validate(_hardware_field(key), {key: value})
        problems += [Problem(("hardware", *p.path), p.message, p.at_key) for p in found]
    return problems


@functools.cache
def _hardware_field(name: str) -> type[BaseModel]:
    """A model of the one Hardware field `name`, so an override is checked by the same rules."""
    field = Hardware.model_fields[name]
    return create_model(f"Hardware_{name}", __config__=ConfigDict(strict=True), **{name: (field.annotation, field)})


def _tvm_problems(p: DeviceProfile) -> list[Problem]:
    """Unknown target options, CPUs LLVM does not know, CUDA arch spelling, then TVM's own verdict."""
    from tvm.target import TargetKind

    problems = []
    for field, spec in (("target", p.target), ("host", p.host)):
        if spec is None:
            continue
        options = {k: v for k, v in TargetKind.options_from_name(spec["kind"]).items() if k != "host"}
        for key, value in spec.items():
            if key not in options:
                problems.append(Problem((field, key), unknown_field(key, sorted(options)), at_key=True))
            elif not _has_option_type(value, options[key]):
                problems.append(Problem((field, key), f"expected {_OPTION_TYPES[options[key]][0]}, "
                                                      f"got {excerpt(repr(value))}"))
        if spec["kind"] == "llvm":
            problems += _mcpu_problems(field, spec)
        arch = spec.get("arch")
        if spec["kind"] == "cuda" and isinstance(arch, str) and not _CUDA_ARCH.fullmatch(arch):
            problems.append(Problem((field, "arch"),
                                    f"expected an NVIDIA architecture like 'sm_80', got '{excerpt(arch)}'"))
    if not problems:
        try:
            p.tvm_target()
        except (ValueError, TypeError, RuntimeError) as exc:
            reason = str(exc).splitlines()[0].split(". Target creation from config dict failed")[0]
            problems.append(Problem(("target",), f"TVM rejects this target: {excerpt(reason, 200)}"))
    return problems


def _mcpu_problems(field: str, spec: Mapping[str, Any]) -> list[Problem]:
    """TVM only logs an unknown -mcpu and then emits generic code, so reject it up front."""
    from tvm.target import Target, codegen

    mcpu, triple = spec.get("mcpu"), spec.get("mtriple") or codegen.llvm_get_system_triple()
    if not isinstance(mcpu, str) or not isinstance(triple, str) or codegen.llvm_is_valid_cpu(mcpu, triple):
        return []
    cpus = list(codegen.llvm_get_cpu_archlist(Target({"kind": "llvm", "mtriple": triple})))
    close = difflib.get_close_matches(mcpu[:100], cpus, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return [Problem((field, "mcpu"), f"LLVM does not know CPU '{excerpt(mcpu)}' for {triple}{hint}")]


_OPTION_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("text", lambda v: isinstance(v, str)),
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "Array<str>": ("a list of text", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
"""TVM target option types (as TargetKind reports them) that are checked before TVM sees them."""


def _has_option_type(value: Any, option_type: str) -> bool:
    """True unless `value` clearly does not fit a TVM option of `option_type`."""
    return option_type not in _OPTION_TYPES or _OPTION_TYPES[option_type][1](value)


@functools.cache
def detect_host() -> dict[str, Any]:
    """What a `detect: true` profile leaves out, measured on this machine (cached per process)."""
    from tvm.target import Target, codegen

    mcpu = codegen.llvm_get_system_cpu()
    if not codegen.llvm_is_valid_cpu(mcpu, codegen.llvm_get_system_triple()):
        mcpu = "generic"  # LLVM can report a CPU name it cannot generate code for
    cores = _physical_cores()
    target: dict[str, Any] = {"kind": "llvm", "mcpu": mcpu, "num-cores": cores}
    missing = _features_missing_on_host(Target(target))
    if missing:
        target["mattr"] = [f"-{f}" for f in missing]
    vector_bits, has_fma = _simd(Target(target))
    l1d_kb, l2_kb, l3_kb = _cache_kb()
    return {
        "isa": machine_isa(),
        "target": target,
        "hardware": {
            "cores": cores,
            "clock_ghz": _clock_ghz(),
            "vector_bits": vector_bits,
            "flops_per_cycle": flops_per_cycle(mcpu, vector_bits, has_fma),
            "vector_pipes": FP_PIPES,
            "l1d_kb": l1d_kb,
            "l2_kb": l2_kb,
            "l3_kb": l3_kb,
        },
    }


def flops_per_cycle(mcpu: str, vector_bits: int, has_fma: bool) -> int:
    """Float32 flops one core can issue a cycle: FP_PIPES pipes of the vector width it runs at full rate."""
    full_rate_bits = min(vector_bits, 256) if mcpu in HALF_RATE_AVX512_CPUS else vector_bits
    return full_rate_bits // 32 * (2 if has_fma else 1) * FP_PIPES


_CHECKED_X86_FEATURES = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni")


def _features_missing_on_host(target: tvm.target.Target) -> list[str]:
    """SIMD features LLVM assumes for the CPU name but the kernel does not report.

    A virtual machine can hide extensions of the CPU model it reports (seen here: a znver-class
    name without AVX-512), and code using them dies with an illegal instruction.
    """
    from tvm.target import codegen

    if machine_isa() != "x86_64":
        return []
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags_line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    flags = set(flags_line.partition(":")[2].split())
    assumed = codegen.llvm_get_cpu_features(target)
    return [f for f in _CHECKED_X86_FEATURES if f in assumed and f not in flags]


def _physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once (they share FP units)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    siblings = set()
    for cpu in cpus:
        try:
            siblings.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return len(cpus)
    return len(siblings)


def _simd(target: tvm.target.Target) -> tuple[int, bool]:
    """(vector width in bits, has FMA) for the host CPU."""
    from tvm.target import codegen

    features = codegen.llvm_get_cpu_features(target)
    if machine_isa() == "x86_64":
        # TVM reports 512 bits for every x86 CPU, so read the width off the ISA extensions.
        width = 512 if "avx512f" in features else 256 if "avx" in features else 128
        return width, "fma" in features
    width = codegen.llvm_get_vector_width(target)
    return (width if width > 0 else 128), True  # Arm NEON/SVE always have FMA


def _clock_ghz() -> float:
    """Maximum clock from cpufreq, else the fastest core in /proc/cpuinfo, else a default."""
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6
    except (OSError, ValueError):
        pass
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        mhz = [float(line.split(":", 1)[1]) for line in lines if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        mhz = []
    return round(max(mhz) / 1000, 3) if mhz else DEFAULT_CLOCK_GHZ


def _cache_kb() -> tuple[int, int, int]:
    """(L1d, L2, L3) sizes in KiB from sysfs; typical values where it says nothing."""
    sizes = {1: 32, 2: 512, 3: 0}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = re.fullmatch(r"(\d+)([KM])", (index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and level in sizes and size:
            sizes[level] = int(size[1]) * (1024 if size[2] == "M" else 1)
    return sizes[1], sizes[2], sizes[3]
