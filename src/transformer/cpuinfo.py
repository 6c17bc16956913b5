"""What the CPU is, from Linux's /proc/cpuinfo, without importing torch: its feature flags
(`translate.auto_dtype` picks the decoding precision by them), the one-line description every
speed figure is printed beside (the benchmarks, whose parent processes stay torch-free), and
how many of its cores this process may use (`usable_cores`: affinity and CPU quota), and how
busy its CPUs have been since the package was imported (`busy_seconds`, `START`)."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

CPUINFO = "/proc/cpuinfo"
STAT = "/proc/stat"
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
    cores = f"{os.cpu_count()} cores"
    usable = usable_cores() if cpuinfo is None else os.cpu_count()
    if usable != os.cpu_count():  # a cpuset, taskset or CPU quota
        cores += f" ({usable} usable)"
    return f"{model}, {cores}, {' '.join(isa) or 'no AVX-512'}"


# The most threads a fixed count may ask for: more than any CPU we run on has, and far below
# where starting them fails (`--threads 99999` exhausted the process's thread limit, and the
# tokenizer's next thread failed in a traceback).
MAX_THREADS = 1024


def count_problem(count: int) -> str | None:
    """What is wrong with a fixed thread count, for "--threads: ..." (None: nothing)."""
    if count < 1:
        return f"at least 1 (or auto), not {count}"
    if count > MAX_THREADS:
        cores = usable_cores()
        return f"at most {MAX_THREADS} (this machine has {cores} usable cores), not {count}"
    return None


def usable_cores(proc: str | Path = "/proc/self", root: str | Path = "/") -> int:
    """The cores this process may use: the CPUs of its affinity (taskset, a container's
    cpuset), and no more than its control groups' CPU quota (`cpu_quota`: Docker's --cpus,
    Kubernetes' CPU limit) rounded to the nearest whole core, at least one.

    Under a quota every thread beyond it waits for the group's next period: on 2 Zen 5 cores,
    `translate` of Multi30k val x 2 with the quickstart model in a group of 1.0 CPU took 6.8 s
    on one thread, 8.6 s on two and 8.1 s in three decoding streams; of 1.2 CPUs 6.9 s, 7.4-7.5
    and 7.0; of 1.5 CPUs 6.9-7.3 s, 6.0-6.1 and 5.8-6.4 (docs/performance.md, "Round
    forty-six"): one thread up to about a core and a half, two from there.

    Args:
        proc: this process's /proc directory (tests pass a fake one).
        root: where the file system's root is (the cgroup mounts are under it; tests).
    """
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cpu_quota(proc, root)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota + 0.5)))
    return cores


def cpu_quota(proc: str | Path = "/proc/self", root: str | Path = "/") -> float | None:
    """The CPUs' worth of time per period that this process's control groups let it run
    (Linux's CFS bandwidth control: cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), the smallest set on its group or any group above it; None where none
    is set or none can be read (no Linux, no cgroup file system mounted)."""
    quotas = _up_the_groups(Path(proc), Path(root), "cpu", _group_quota)
    return min(quotas) if quotas else None


def _up_the_groups(proc: Path, root: Path, controller: str, read: Callable) -> list:
    """`read(version, directory)` of the process's group and of every group above it, in each
    hierarchy of `controller` (`_cgroups`), where not None."""
    found = []
    for version, directory, top in _cgroups(proc, root, controller):
        while True:
            value = read(version, directory)
            if value is not None:
                found.append(value)
            if directory == top or directory.parent == directory:
                break
            directory = directory.parent
    return found


def _group_quota(version: int, directory: Path) -> float | None:
    """One group's quota in CPUs (None: unlimited, or no readable setting)."""
    try:
        if version == 2:  # "max 100000" (unlimited) or "150000 100000"
            quota, _, period = (directory / "cpu.max").read_text(encoding="ascii").partition(" ")
        else:  # -1: unlimited
            quota = (directory / "cpu.cfs_quota_us").read_text(encoding="ascii")
            period = (directory / "cpu.cfs_period_us").read_text(encoding="ascii")
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def available_memory(proc: str | Path = "/proc/self", root: str | Path = "/") -> int | None:
    """Bytes this process can still take: the kernel's estimate of available memory
    (/proc/meminfo's MemAvailable), and no more than each control group's memory limit above
    its usage (cgroup v2 `memory.max` over `memory.current`, v1 `memory.limit_in_bytes` over
    `memory.usage_in_bytes`; the group's inactive file pages, which the kernel drops before it
    kills, not counted as used), on the process's group and every group above it; None where
    none of these can be read."""
    found = []
    try:
        for line in (Path(root) / "proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        pass
    found += _up_the_groups(Path(proc), Path(root), "memory", _group_memory)
    return max(0, min(found)) if found else None


def _group_memory(version: int, directory: Path) -> int | None:
    """One group's memory limit less its usage (None: unlimited, or nothing readable)."""
    names = (("memory.max", "memory.current", ("inactive_file",)) if version == 2 else
             ("memory.limit_in_bytes", "memory.usage_in_bytes",
              ("total_inactive_file", "inactive_file")))  # fmt: skip
    try:
        limit_text = (directory / names[0]).read_text(encoding="ascii").strip()
        if limit_text == "max":
            return None
        limit = int(limit_text)
        used = int((directory / names[1]).read_text(encoding="ascii"))
        stat = dict(
            line.split(None, 1)
            for line in (directory / "memory.stat").read_text(encoding="ascii").splitlines()
            if " " in line
        )
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if limit >= 2**60:  # v1's "unlimited": a page-rounded LONG_MAX
        return None
    inactive = next((int(stat[n]) for n in names[2] if stat.get(n, "").strip().isdigit()), 0)
    return limit - max(0, used - inactive)


def _cgroups(proc: Path, root: Path, controller: str) -> list[tuple[int, Path, Path]]:
    """(cgroup version, this process's group directory, its mount's top directory) for the
    cgroup v2 hierarchy and the v1 hierarchy of `controller` ("cpu", "memory"), where mounted
    (/proc/self/mountinfo) and named in /proc/self/cgroup."""
    try:
        mounts = (proc / "mountinfo").read_text(encoding="utf-8", errors="replace")
        groups = (proc / "cgroup").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    paths: dict[int, str] = {}  # version -> the group's path in that hierarchy
    for line in groups.splitlines():  # "0::/user.slice/...", "4:cpu,cpuacct:/docker/..."
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and not controllers:
            paths.setdefault(2, path)
        elif controller in controllers.split(","):
            paths.setdefault(1, path)
    found = []
    for line in mounts.splitlines():
        # "36 25 0:30 / /sys/fs/cgroup/cpu rw,nosuid shared:9 - cgroup cgroup rw,cpu,cpuacct"
        mine, _, theirs = line.partition(" - ")
        mine_fields, theirs_fields = mine.split(), theirs.split()
        if len(mine_fields) < 5 or len(theirs_fields) < 3:
            continue
        mount_root, point = _unescape(mine_fields[3]), _unescape(mine_fields[4])
        fstype, options = theirs_fields[0], theirs_fields[2].split(",")
        version = (
            2 if fstype == "cgroup2" else 1 if fstype == "cgroup" and controller in options else 0
        )
        if version not in paths:
            continue
        path = paths.pop(version)
        # The group's path is from its hierarchy's root; the mount shows `mount_root` of it
        # (a container without its own cgroup namespace: its group, where the path goes on).
        under = path == mount_root or path.startswith(mount_root.rstrip("/") + "/")
        inside = path[len(mount_root) :] if under else ""
        top = root / point.lstrip("/")
        found.append((version, top / inside.strip("/") if inside.strip("/") else top, top))
    return found


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def busy_seconds(stat: str | os.PathLike = STAT, cpus: set[str] | None = None) -> float | None:
    """The busy seconds since boot of the CPUs named in `cpus` ("cpu0", ...; None: all), from
    Linux's /proc/stat: user, nice, system, irq and softirq (not idle, iowait or steal); None
    where it cannot be read or names none of them."""
    try:
        with open(stat, encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError):
        return None
    busy = 0
    seen = 0
    for line in lines:
        name, *fields = line.split() or [""]  # a blank line: no name, skipped
        if not (name.startswith("cpu") and name != "cpu"):
            continue
        if cpus is not None and name not in cpus:
            continue
        try:  # user nice system idle iowait irq softirq ...
            user, nice, system, _, _, irq, softirq = (int(v) for v in fields[:7])
        except ValueError:
            return None
        busy += user + nice + system + irq + softirq
        seen += 1
    if not seen:
        return None
    return busy / clock_ticks()


def clock_ticks() -> int:
    """The clock ticks per second in which /proc counts CPU time (100 on Linux as built)."""
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def affinity_names() -> set[str] | None:
    """The CPUs this process may run on, as /proc/stat names them ("cpu0", ...), or None."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return {f"cpu{c}" for c in os.sched_getaffinity(0)}


# When the package was first imported (`transformer/__init__`): (monotonic seconds, busy
# seconds of this process's CPUs, this process's CPU seconds, those CPUs), or None where
# /proc/stat cannot be read. A command's imports take ~0.7 s of one core before its first model
# op: others' use of the CPUs meanwhile tells whether they are crowded before anything is timed
# (`threads.OtherLoad.since_start`).
START: tuple[float, float, float, set[str] | None] | None = None


def mark_start() -> None:
    """Set `START` to now."""
    global START
    cpus = affinity_names()
    busy = busy_seconds(STAT, cpus)
    START = None if busy is None else (time.monotonic(), busy, time.process_time(), cpus)
