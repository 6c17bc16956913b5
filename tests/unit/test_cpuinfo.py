"""cpuinfo.py: the CPU's flags and the line every speed figure is printed beside."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.cpuinfo import cpu_flags, cpu_line, fields, native_bf16

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_contention.py"


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
def test_the_core_generation_is_named_from_family_and_model(vendor, family, model, core):
    info = _cpuinfo(vendor, family, model, "AMD EPYC", "avx512f avx512_bf16 amx_bf16")
    line = cpu_line(info)
    assert line.startswith(f"AMD EPYC (family {family} model {model}: {core}), ")
    assert line.endswith(" avx512f avx512_bf16 amx_bf16")


def test_an_unknown_cpu_keeps_its_numbers_and_a_cpu_without_avx512_says_so():
    line = cpu_line(_cpuinfo("GenuineIntel", 6, 1, "Some CPU", "avx2"))
    assert line.startswith("Some CPU (family 6 model 1), ")
    assert line.endswith("no AVX-512")
    bare = cpu_line("")  # no /proc/cpuinfo: still a line, no error, no made-up generation
    assert "(family" not in bare and bare.endswith(" cores, no AVX-512")


def test_fields_are_the_first_processors_and_flags_come_from_them(tmp_path):
    info = _cpuinfo("AuthenticAMD", 26, 2, "AMD EPYC", "avx512f avx512_vnni")
    info += "flags\t\t: other\nweird line without a colon\n"
    assert fields(info)["cpu family"] == "26" and fields(info)["flags"].endswith("avx512_vnni")
    path = tmp_path / "cpuinfo"
    path.write_text(info, encoding="utf-8")
    assert cpu_flags(path) == {"fpu", "sse2", "avx512f", "avx512_vnni"}


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8\n"
        "bugs\t\t: spectre_v1\n\nprocessor\t: 1\nflags\t\t: fpu sse2\n",
        encoding="utf-8",
    )
    flags = cpu_flags(info)
    assert {"amx_bf16", "amx_tile", "avx512_vnni", "fpu"} <= flags and "spectre_v1" not in flags
    assert cpu_flags(tmp_path / "missing") == set()  # not Linux: no flags, no error
    (tmp_path / "noflags").write_text("processor\t: 0\n", encoding="utf-8")
    assert cpu_flags(tmp_path / "noflags") == set()


def test_the_benchmarks_print_the_packages_line_without_importing_torch():
    spec = importlib.util.spec_from_file_location("bench_contention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.cpu_line is cpu_line
    # bench_peers.sh prints it with the peers' interpreter: the module needs no torch
    code = "import sys, transformer.cpuinfo as c; c.cpu_line(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("flags", "native"),
    [("avx2 avx512f avx512_bf16 avx512_vnni", ["avx512_bf16"]),
     ("avx2 avx512f avx512_bf16 amx_bf16 amx_tile", ["amx_bf16", "avx512_bf16"]),
     ("avx2 avx512f avx512bw", []), ("sse2 avx2 fma", [])],
)  # fmt: skip
def test_native_bf16_names_the_flags_of_native_bf16_products(tmp_path, flags, native):
    # train.dtype=auto and bench_peers.sh take bf16 only where this is not empty.
    path = tmp_path / "cpuinfo"
    path.write_text(_cpuinfo("AuthenticAMD", 25, 1, "AMD EPYC", flags), encoding="utf-8")
    assert native_bf16(path) == native
    assert native_bf16(tmp_path / "missing") == []
