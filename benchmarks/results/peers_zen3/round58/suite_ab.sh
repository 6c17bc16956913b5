#!/usr/bin/env bash
# The whole suite (scripts/test.sh's pytest line) at OLD and at the working tree, alternated:
# old, new, new, old, ... ROUNDS rounds; each run's wall time and its last line.
# Usage: OLD=dc3ed93 ROUNDS=2 bash benchmarks/results/peers_zen3/round58/suite_ab.sh
# (.venv from scripts/test.sh, linked into OLD's tree: a worktree beside the repository, where
# ../shared is the same, its src first on PYTHONPATH; each run's output in
# /tmp/suite_ab_{old,new}_ROUND.log; run alone on the machine).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OLD=${OLD:-dc3ed93}
ROUNDS=${ROUNDS:-2}
PY=$PWD/.venv/bin/python
OLD_TREE=$(dirname "$PWD")/suite_old
rm -rf "$OLD_TREE" && git worktree prune && git worktree add -q -f "$OLD_TREE" "$OLD"
ln -s "$PWD/.venv" "$OLD_TREE/.venv"  # the scripts some tests run take the tree's .venv
trap 'git worktree remove -f "$OLD_TREE"' EXIT
grep -m1 'model name' /proc/cpuinfo; nproc; uptime
run() {  # $1: old or new, $2: the round
    local dir=$PWD pp=""
    [ "$1" = old ] && dir=$OLD_TREE && pp=$OLD_TREE/src
    local t0 t1 last
    t0=$(date +%s.%N)
    (cd "$dir" && PYTHONPATH=$pp OMP_NUM_THREADS=1 "$PY" -m pytest -q -n auto --dist worksteal \
        tests -p no:cacheprovider > "/tmp/suite_ab_$1_$2.log" 2>&1) || true  # failures: in the log
    last=$(tail -1 "/tmp/suite_ab_$1_$2.log")
    t1=$(date +%s.%N)
    printf '%s %s: %.1f s wall | %s | load %s\n' "$(date -u +%H:%M:%S)" "$1" \
        "$(echo "$t1 - $t0" | bc)" "$last" "$(cut -d' ' -f1-3 /proc/loadavg)"
}
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then run old "$r"; run new "$r"; else run new "$r"; run old "$r"; fi
done
