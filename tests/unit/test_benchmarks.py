"""The benchmarks' CPU line: every speed figure is printed beside the CPU it was measured on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_contention.py"


@pytest.fixture(scope="module")
def cpu_line():
    spec = importlib.util.spec_from_file_location("bench_contention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.cpu_line


def _cpuinfo(vendor: str, family: int, model: int, name: str, flags: str) -> str:
    return (
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {name}\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n"
    )


@pytest.mark.parametrize(
    "vendor, family, model, core",
    [
        ("AuthenticAMD", 25, 17, "Zen 4"),  # EPYC 9004 (Genoa)
        ("AuthenticAMD", 26, 2, "Zen 5"),  # EPYC 9005 (Turin): the KVM guest says "AMD EPYC"
        ("GenuineIntel", 6, 143, "Sapphire Rapids"),
    ],
)
def test_the_core_generation_is_named_from_family_and_model(cpu_line, vendor, family, model, core):
    info = _cpuinfo(vendor, family, model, "AMD EPYC", "avx512f avx512_bf16 amx_bf16")
    line = cpu_line(info)
    assert line.startswith(f"AMD EPYC (family {family} model {model}: {core}), ")
    assert line.endswith(" avx512f avx512_bf16 amx_bf16")


def test_an_unknown_cpu_keeps_its_numbers_and_a_cpu_without_avx512_says_so(cpu_line):
    line = cpu_line(_cpuinfo("GenuineIntel", 6, 1, "Some CPU", "avx2"))
    assert line.startswith("Some CPU (family 6 model 1), ")
    assert line.endswith("no AVX-512")
    bare = cpu_line("")  # no /proc/cpuinfo: still a line, no error, no made-up generation
    assert "(family" not in bare and bare.endswith(" cores, no AVX-512")
