cd /work/shared/peers
for r in 1 2; do
for tree in /work/main /tmp/old33; do
  echo "== $tree round $r $(uptime)"
  PYTHONPATH=$tree/benchmarks:$tree/src /tmp/pv/bin/python bench_memory.py --impl ext:peers_adapter:make_train --dtype fp32 --sents 512 --json /tmp/z3/w3_$(basename $tree)_$r.json 2>&1 | grep 'peak '
done; done
