"""What the CPU is, from Linux's /proc/cpuinfo, without importing torch: its feature flags
(`translate.auto_dtype` picks the decoding precision by them) and the one-line description every
speed figure is printed beside (the benchmarks, whose parent processes stay torch-free)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CPUINFO = "/proc/cpuinfo"
# (vendor, family, model range) -> core generation, for CPUs whose model name says too little
# (a KVM guest of an AMD EPYC reports just "AMD EPYC"). AMD's family 25 holds both Zen 3 and
# Zen 4 parts, told apart by the model; family 26 is Zen 5.
CORES = (
    ("AuthenticAMD", 25, range(0x10, 0x20), "Zen 4"),
    ("AuthenticAMD", 25, range(0x60, 0x80), "Zen 4"),
    ("AuthenticAMD", 25, range(0xA0, 0xB0), "Zen 4c"),
    ("AuthenticAMD", 25, range(0x00, 0x10), "Zen 3"),
    ("AuthenticAMD", 25, range(0x20, 0x60), "Zen 3"),
    ("AuthenticAMD", 26, range(0x00, 0x100), "Zen 5"),
    ("GenuineIntel", 6, range(0x8F, 0x90), "Sapphire Rapids"),
    ("GenuineIntel", 6, range(0xCF, 0xD0), "Emerald Rapids"),
    ("GenuineIntel", 6, range(0xAD, 0xAE), "Granite Rapids"),
)
# The flags that decide the matmul rate: AVX-512, its bf16 and 8-bit dot products, AMX tiles.
ISA = ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni")
# Native bf16 dot products (AVX512-BF16's vdpbf16ps, AMX's tiles): with them a bf16 product runs
# at 2-5x fp32's rate; without them oneDNN and MKL fall back to slow kernels (an AVX2 Zen 3: bf16
# linear 14 GFLOP/s, bmm 3, against fp32's 157 and 108). `train.auto_train_dtype` reads them.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def read(path: str | Path | None = None) -> str:
    """The text of /proc/cpuinfo (or `path`); empty where there is none (other systems)."""
    try:
        return Path(path or CPUINFO).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def fields(text: str) -> dict[str, str]:
    """The first processor's fields ("flags", "model name", "cpu family", ...): the first
    occurrence of each key; the cores of one machine list the same."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            found.setdefault(key.strip(), value.strip())
    return found


def cpu_flags(path: str | Path | None = None) -> set[str]:
    """The CPU's feature flags as Linux lists them (the first "flags" line of /proc/cpuinfo);
    empty where there is no such file (other systems) or no such line."""
    return set(fields(read(path)).get("flags", "").split())


def native_bf16(path: str | Path | None = None) -> list[str]:
    """This CPU's flags of native bf16 products (sorted; empty: bf16 runs in slow fallbacks)."""
    return sorted(NATIVE_BF16_FLAGS & cpu_flags(path))


def cpu_line(cpuinfo: str | None = None) -> str:
    """CPU model, its core generation (from family and model), core count and the
    matmul-relevant ISA flags: "AMD EPYC (family 26 model 2: Zen 5), 2 cores, avx512f ...".

    Args:
        cpuinfo: the text of /proc/cpuinfo (default: this machine's).
    """
    info = fields(read() if cpuinfo is None else cpuinfo)
    model = info.get("model name") or platform.processor() or "?"
    vendor, family, number = info.get("vendor_id"), info.get("cpu family"), info.get("model")
    if family is not None and number is not None and family.isdigit() and number.isdigit():
        core = next(
            (name for v, f, models, name in CORES
             if v == vendor and f == int(family) and int(number) in models),
            None,
        )  # fmt: skip
        model += f" (family {family} model {number}{': ' + core if core else ''})"
    flags = set(info.get("flags", "").split())
    isa = [f for f in ISA if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX-512'}"
