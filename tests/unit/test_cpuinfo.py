"""cpuinfo.py: the CPU's flags and the line every speed figure is printed beside."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from transformer.cpuinfo import cpu_flags, cpu_line, cpu_quota, fields, native_bf16

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


# The cores a process may use: its affinity and its control groups' CPU quota.

HOST_V1 = "36 25 0:30 / /sys/fs/cgroup/cpu rw,relatime shared:9 - cgroup cgroup rw,cpu\n"
UNIFIED = "37 25 0:31 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw\n"


def _proc(tmp_path, mountinfo: str, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(
        "22 1 253:0 / / rw,relatime - ext4 /dev/vda rw\n" + mountinfo, encoding="utf-8"
    )
    (proc / "cgroup").write_text(cgroup, encoding="utf-8")
    return proc


def _write(root: Path, path: str, text: str) -> None:
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text, encoding="ascii")


def test_a_cgroup_v2_quota_is_read_from_the_process_group_and_every_group_above(tmp_path):
    # systemd's slice limits 3 CPUs, the service 1.5: the smaller counts, wherever it is set.
    root = tmp_path / "root"
    mount = "30 25 0:27 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
    proc = _proc(tmp_path, mount, "0::/app.slice/job.service\n")
    _write(root, "sys/fs/cgroup/cpu.stat", "")  # the root group has no cpu.max
    _write(root, "sys/fs/cgroup/app.slice/cpu.max", "300000 100000\n")
    _write(root, "sys/fs/cgroup/app.slice/job.service/cpu.max", "max 100000\n")
    assert cpu_quota(proc, root) == 3.0
    _write(root, "sys/fs/cgroup/app.slice/job.service/cpu.max", "75000 50000\n")
    assert cpu_quota(proc, root) == 1.5


def test_a_container_sees_its_own_group_as_the_mounts_top(tmp_path):
    # Docker --cpus=2 with a cgroup namespace: "0::/" and the container's group at the mount.
    root = tmp_path / "root"
    mount = "30 25 0:27 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw\n"
    proc = _proc(tmp_path, mount, "0::/\n")
    _write(root, "sys/fs/cgroup/cpu.max", "200000 100000\n")
    assert cpu_quota(proc, root) == 2.0


def test_a_cgroup_v1_quota_on_a_hybrid_host_and_in_a_container_without_its_namespace(tmp_path):
    # This project's VMs: the cpu controller on v1, an empty v2 beside it. -1: unlimited.
    root = tmp_path / "root"
    proc = _proc(tmp_path, HOST_V1 + UNIFIED, "4:cpu:/q1\n0::/\n")
    _write(root, "sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n")
    _write(root, "sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(proc, root) is None  # the process's group has no files: only the top's
    _write(root, "sys/fs/cgroup/cpu/q1/cpu.cfs_quota_us", "120000\n")
    _write(root, "sys/fs/cgroup/cpu/q1/cpu.cfs_period_us", "100000\n")
    assert cpu_quota(proc, root) == 1.2
    # An old Docker: the mount shows the container's group itself, named by its host path;
    # a mount point with a space in it comes escaped.
    root2 = tmp_path / "root2"
    mount = ("40 30 0:35 /docker/abc /sys/fs/cgroup/cpu\\040x rw - cgroup cgroup "
             "rw,cpuacct,cpu\n")  # fmt: skip
    proc2 = tmp_path / "p2"
    proc2.mkdir()
    (proc2 / "mountinfo").write_text(mount, encoding="utf-8")
    (proc2 / "cgroup").write_text("3:cpu,cpuacct:/docker/abc\n", encoding="utf-8")
    _write(root2, "sys/fs/cgroup/cpu x/cpu.cfs_quota_us", "50000")
    _write(root2, "sys/fs/cgroup/cpu x/cpu.cfs_period_us", "100000")
    assert cpu_quota(proc2, root2) == 0.5


@pytest.mark.parametrize(
    "files",
    [
        {},  # no cgroup files at all: no quota
        {"mountinfo": "garbage\n\n- -\n", "cgroup": "::\nno colons\n"},
        {"mountinfo": UNIFIED, "cgroup": "0::/x\n", "sys/fs/cgroup/unified/x/cpu.max": "big 1"},
        {"mountinfo": UNIFIED, "cgroup": "0::/x\n", "sys/fs/cgroup/unified/x/cpu.max": "0 0"},
        {"mountinfo": UNIFIED, "cgroup": "0::/x\n", "sys/fs/cgroup/unified/x/cpu.max": b"\xff"},
    ],
)
def test_no_quota_where_nothing_readable_sets_one(tmp_path, files):
    proc, root = tmp_path / "proc", tmp_path / "root"
    proc.mkdir()
    for name, text in files.items():
        path = proc / name if name in ("mountinfo", "cgroup") else root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert cpu_quota(proc, root) is None


@pytest.mark.parametrize(
    ("quota", "cores"), [(None, 2), (0.3, 1), (1.0, 1), (1.2, 1), (1.5, 2), (1.9, 2), (8.0, 2)]
)
def test_usable_cores_rounds_the_quota_to_the_nearest_core_within_the_affinity(
    monkeypatch, quota, cores
):
    # Measured on 2 Zen 5 cores: one thread is fastest in a group of 1.0 or 1.2 CPUs, two in one
    # of 1.5 (docs/performance.md, "Round forty-six").
    import transformer.cpuinfo as cpuinfo

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setattr(cpuinfo, "cpu_quota", lambda *_: quota)
    assert cpuinfo.usable_cores() == cores
    line = cpu_line()
    assert line.count(" cores") == 1 and (f"({cores} usable)" in line) == (cores != os.cpu_count())


def test_a_process_limited_to_one_cpu_counts_one_core_without_being_told(tmp_path):
    # A real affinity, no mocks: a child on CPU 0 only sees one usable core and no streams.
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from transformer.cpuinfo import usable_cores, cpu_line;"
        "from transformer.threads import ThreadTuner;"
        "print(usable_cores(), ThreadTuner.for_this_machine().candidates, cpu_line())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    cores, rest = out.stdout.split(" ", 1)
    assert cores == "1" and rest.startswith("[1]")
    assert ("(1 usable)" in rest) == ((os.cpu_count() or 1) > 1)


def test_available_memory_is_the_least_of_memavailable_and_each_groups_room(tmp_path):
    # MemAvailable alone; then a v1 group's limit over its usage less its inactive file pages
    # (dropped before the kernel kills); then a v2 parent's tighter limit; "max": none.
    from transformer.cpuinfo import available_memory

    root = tmp_path / "root"
    _write(root, "proc/meminfo", "MemTotal: 24000000 kB\nMemAvailable:   8000000 kB\n")
    mem_v1 = "38 25 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    proc = _proc(tmp_path, mem_v1, "5:memory:/m1\n0::/\n")
    assert available_memory(proc, root) == 8000000 * 1024
    _write(root, "sys/fs/cgroup/memory/m1/memory.limit_in_bytes", str(2500 * 2**20))
    _write(root, "sys/fs/cgroup/memory/m1/memory.usage_in_bytes", str(1000 * 2**20))
    _write(root, "sys/fs/cgroup/memory/m1/memory.stat",
           f"cache 1\ntotal_inactive_file {300 * 2**20}\n")  # fmt: skip
    assert available_memory(proc, root) == 1800 * 2**20
    _write(root, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712")  # none
    assert available_memory(proc, root) == 1800 * 2**20
    root2 = tmp_path / "root2"
    _write(root2, "proc/meminfo", "MemAvailable: 8000000 kB\n")
    mount = "30 25 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    proc2 = tmp_path / "p2"
    proc2.mkdir()
    (proc2 / "mountinfo").write_text(mount, encoding="utf-8")
    (proc2 / "cgroup").write_text("0::/a/b\n", encoding="utf-8")
    _write(root2, "sys/fs/cgroup/a/b/memory.max", "max\n")
    _write(root2, "sys/fs/cgroup/a/memory.max", f"{2**30}\n")
    _write(root2, "sys/fs/cgroup/a/memory.current", f"{2**29}\n")
    _write(root2, "sys/fs/cgroup/a/memory.stat", "anon 1\ninactive_file 0\n")
    assert available_memory(proc2, root2) == 2**29
    _write(root2, "sys/fs/cgroup/a/memory.current", f"{2**31}\n")  # over its limit: none left
    assert available_memory(proc2, root2) == 0
    assert available_memory(tmp_path / "none", tmp_path / "nothing") is None
