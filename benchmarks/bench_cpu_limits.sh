#!/usr/bin/env bash
# `transformer translate --threads auto` where the process may use fewer cores than the machine
# has: under a cgroup CPU quota (Docker --cpus, a Kubernetes CPU limit) and under `taskset`,
# this tree against another (`git worktree add /tmp/old REV`), in alternating fresh processes
# (bench_translate_stream.py: words/s, peak RSS, outputs compared byte for byte). Needs root
# for the control group (cgroup v2 with the cpu controller, or v1's cpu hierarchy); without it,
# only the taskset and unlimited runs. docs/performance.md, "Round forty-six".
#
#   bash benchmarks/bench_cpu_limits.sh /tmp/old/src MODEL INPUT
#
# Environment: RUNS per tree and case (default 4); QUOTAS, CPUs per period, space-separated
# (default "1.0 1.2 1.5"; "none": no quota runs); PY (default .venv/bin/python).
set -euo pipefail
fail() { echo "bench_cpu_limits.sh: $*" >&2; exit 2; }
[ $# -eq 3 ] || fail "usage: bench_cpu_limits.sh OLD_SRC MODEL INPUT (got $# arguments)"
OLD=$1 MODEL=$2 INPUT=$3
RUNS=${RUNS:-4}
QUOTAS=${QUOTAS:-1.0 1.2 1.5}
[ -d "$OLD/transformer" ] || fail "$OLD: not a tree's src (no transformer package in it)"
[ -e "$MODEL" ] || fail "$MODEL: no such model file or run directory"
[ -f "$INPUT" ] || fail "$INPUT: no such input file"
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || fail "RUNS=$RUNS: a count of at least 1"
[ "$QUOTAS" = none ] && QUOTAS=""
for q in $QUOTAS; do
    [[ $q =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] && [ "$(python3 -c "print($q > 0)")" = True ] ||
        fail "QUOTAS: $q is not a positive number of CPUs"
done
command -v taskset >/dev/null || fail "taskset not found (util-linux)"
OLD=$(realpath "$OLD") MODEL=$(realpath "$MODEL") INPUT=$(realpath "$INPUT")
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
AB=(benchmarks/bench_translate_stream.py --runs "$RUNS" --before "$OLD" "$MODEL" "$INPUT" -- --threads auto)
NAME=transformer-bench-$$
GROUP=""
if [ -n "$QUOTAS" ] && [ "$(id -u)" = 0 ]; then
    if grep -qw cpu /sys/fs/cgroup/cgroup.controllers 2>/dev/null; then
        GROUP=/sys/fs/cgroup/$NAME  # v2: the cpu controller must be on in the parent
        echo +cpu >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    elif [ -d /sys/fs/cgroup/cpu ]; then
        GROUP=/sys/fs/cgroup/cpu/$NAME  # v1
    fi
fi
cleanup() { [ -n "$GROUP" ] && rmdir "$GROUP" 2>/dev/null || true; }
trap cleanup EXIT
set_quota() {  # CPUs
    local us
    us=$(python3 -c "print(round($1 * 100000))")
    if [ -f "$GROUP/cpu.max" ] || [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        echo "$us 100000" >"$GROUP/cpu.max"
    else
        echo 100000 >"$GROUP/cpu.cfs_period_us"
        echo "$us" >"$GROUP/cpu.cfs_quota_us"
    fi
}
uptime
if [ -z "$QUOTAS" ]; then
    echo "== no quota runs (QUOTAS=none)"
elif [ -n "$GROUP" ] && mkdir -p "$GROUP" 2>/dev/null; then
    for q in $QUOTAS; do
        set_quota "$q"
        echo "== a quota of $q CPU"
        # The children of this shell inherit its group: run the benchmark from a subshell in it.
        (echo $BASHPID >"$GROUP/cgroup.procs" && exec "$PY" "${AB[@]}")
    done
else
    echo "== no cgroup quota (needs root and a cgroup file system with the cpu controller)"
fi
echo "== taskset -c 0 (one CPU of the affinity)"
taskset -c 0 "$PY" "${AB[@]}"
echo "== no limit"
"$PY" "${AB[@]}"
uptime
