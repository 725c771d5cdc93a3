"""Device profiles: shipped ones are valid for TVM, host detection is sane, overrides merge and are checked."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from tvm.target import Target, codegen

from edgetune.errors import InputError
from edgetune.profiles import (
    flops_per_cycle,
    list_profiles,
    load_profile,
    machine_isa,
    profile_names,
    resolve_profile,
)
from edgetune.yamlsource import InvalidData

REQUIRED = {
    "host",
    "raspberry-pi-4",
    "cortex-a53",
    "jetson-orin",
    "mali-g76",
    "adreno-640",
    "a100",
    "h100",
    "x86-server",
}


def test_required_profiles_are_shipped() -> None:
    assert set(profile_names()) >= REQUIRED


@pytest.mark.parametrize("name", profile_names())
def test_shipped_profile_loads_and_builds_a_tvm_target(name: str) -> None:
    profile = load_profile(name)
    assert profile.name == name
    target = profile.tvm_target()
    assert isinstance(target, Target)
    assert target.kind.name == profile.target["kind"]
    if profile.host:
        assert target.host is not None and target.host.kind.name == "llvm"
    hw = profile.hardware
    assert hw.peak_gflops is not None and hw.peak_gflops > 0
    assert hw.compute_units >= 1


def test_list_profiles_matches_names() -> None:
    assert [p.name for p in list_profiles()] == profile_names()


def test_datasheet_peaks() -> None:
    peaks = {p.name: p.hardware.peak_gflops for p in list_profiles()}
    assert peaks["raspberry-pi-4"] == 48.0
    assert peaks["a100"] == pytest.approx(19490, rel=0.01)
    assert peaks["jetson-orin"] == pytest.approx(5325, rel=0.01)


def test_host_detection() -> None:
    host = load_profile("host")
    mcpu = host.target["mcpu"]
    assert codegen.llvm_is_valid_cpu(mcpu, codegen.llvm_get_system_triple())
    assert host.hardware.cores is not None and host.hardware.cores >= 1
    assert host.target["num-cores"] == host.hardware.cores
    assert host.isa == machine_isa()
    assert host.is_native
    hw = host.hardware
    assert hw.vector_bits is not None and hw.vector_bits >= 128
    assert hw.peak_gflops == pytest.approx(hw.cores * hw.clock_ghz * hw.flops_per_cycle, abs=0.1)


def test_host_detection_counts_flops_at_the_rate_the_cpu_runs_its_vectors() -> None:
    assert flops_per_cycle("skylake-avx512", 512, True) == 64  # two 512-bit FMA pipes
    assert flops_per_cycle("znver4", 512, True) == 32  # AVX-512 on two 256-bit pipes, as AVX2
    assert flops_per_cycle("znver3", 256, True) == 32
    assert flops_per_cycle("cortex-a72", 128, True) == 16


def test_gpu_target_has_host() -> None:
    target = load_profile("jetson-orin").tvm_target()
    assert str(target.attrs["arch"]) == "sm_87"
    assert str(target.host.attrs["mcpu"]) == "cortex-a78ae"


def test_is_native() -> None:
    assert not load_profile("raspberry-pi-4").is_native  # cross compiled
    assert not load_profile("adreno-640").is_native


def test_overrides_merge() -> None:
    base = load_profile("raspberry-pi-4")
    pi = resolve_profile("raspberry-pi-4", {"hardware": {"cores": 2}, "target": {"num-cores": 2}})
    assert pi.hardware.cores == 2 and pi.target["num-cores"] == 2
    assert pi.hardware.clock_ghz == base.hardware.clock_ghz  # untouched fields survive the merge
    assert pi.target["mcpu"] == "cortex-a72" and pi.target["mattr"] == ["+neon"]
    assert pi.hardware.peak_gflops == 24.0  # recomputed from the overridden core count
    assert load_profile("raspberry-pi-4").hardware.cores == 4


def test_override_of_host_profile() -> None:
    host = resolve_profile("host", {"hardware": {"cores": 1}, "target": {"num-cores": 1}})
    assert host.hardware.cores == 1 and host.target["num-cores"] == 1
    assert host.target["mcpu"] == load_profile("host").target["mcpu"]


def test_bogus_mcpu_override_is_an_input_error() -> None:
    with pytest.raises(InputError) as info:
        resolve_profile("host", {"target": {"mcpu": "notacpu"}})
    assert info.value.exit_code == 2
    assert info.value.problems[0].startswith("overrides.target.mcpu: LLVM does not know CPU 'notacpu'")


def test_mcpu_suggestion_for_cross_target() -> None:
    with pytest.raises(InvalidData) as info:
        resolve_profile("raspberry-pi-4", {"target": {"mcpu": "cortex-a72x"}})
    assert "did you mean 'cortex-a72'" in info.value.problems[0]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"hardwre": {"cores": 1}}, "overrides.hardwre: unknown field; did you mean 'hardware'?"),
        ({"hardware": {"corse": 1}}, "overrides.hardware.corse: unknown field; did you mean 'cores'?"),
        ({"target": {"num-core": 2}}, "overrides.target.num-core: unknown field; did you mean 'num-cores'?"),
        ({"target": {"num-cores": "two"}}, "overrides.target.num-cores: expected a whole number, got 'two'"),
        ({"hardware": {"cores": 0}}, "overrides.hardware.cores: must be at least 1 and at most 1024"),
        ({"target": {"kind": "cuda"}}, "overrides.target.kind: expected 'llvm' for device 'cpu'"),
    ],
)
def test_bad_overrides(overrides: dict, fragment: str) -> None:
    with pytest.raises(InvalidData) as info:
        resolve_profile("raspberry-pi-4", overrides)
    assert any(fragment in p for p in info.value.problems), info.value.problems


def test_unknown_profile() -> None:
    with pytest.raises(InputError, match="unknown device profile 'raspbery-pi-4'; did you mean 'raspberry-pi-4'"):
        load_profile("raspbery-pi-4")


def test_broken_profile_file_is_located(tmp_path: Path) -> None:
    (tmp_path / "board.yaml").write_text(
        textwrap.dedent(
            """\
            name: board
            description: a board
            isa: aarch64
            device: cpu
            target: {kind: llvm, mtriple: aarch64-linux-gnu, mcpu: cortex-a7200}
            hardware:
              cores: 4
              clock_ghz: 1.5
              vector_bits: 128
              flops_per_cycle: 8
              l1d_kb: 32
              l2_kb: 512
              memory_bandwidth_gbs: 4
            """
        )
    )
    with pytest.raises(InputError) as info:
        load_profile("board", tmp_path)
    assert info.value.problems[0].startswith(f"{tmp_path / 'board.yaml'}:5: target.mcpu: LLVM does not know CPU")


def test_profile_schema_errors_are_located(tmp_path: Path) -> None:
    (tmp_path / "board.yaml").write_text(
        textwrap.dedent(
            """\
            name: other
            description: a board
            isa: sparc
            device: cpu
            target: {kind: llvm}
            hardware:
              cores: 4
              clock_ghz: fast
              l1d_kb: 32
              l2_kb: 512
              memory_bandwith_gbs: 4
            """
        )
    )
    with pytest.raises(InputError) as info:
        load_profile("board", tmp_path)
    file = tmp_path / "board.yaml"
    found = info.value.problems
    assert f"{file}:1: name: must match the file name 'board'" in found
    assert any(p.startswith(f"{file}:3: isa: expected 'x86_64'") for p in found)
    assert f"{file}:8: hardware.clock_ghz: expected a number, got 'fast'" in found
    assert f"{file}:6: hardware.flops_per_cycle: required field is missing" in found
    assert f"{file}:11: hardware.memory_bandwith_gbs: unknown field; did you mean 'memory_bandwidth_gbs'?" in found
