cd /work/shared/peers
for r in 1 2; do
for tree in /tmp/h57 /work/main; do
  for s in 512 128; do
  echo "== $tree ($(git -C $tree log -1 --format=%h), working tree: $(git -C $tree status --short src | wc -l) changed) sents $s round $r $(uptime)"
  PYTHONPATH=$tree/benchmarks:$tree/src /tmp/pv/bin/python bench_memory.py --impl ext:peers_adapter:make_train --dtype fp32 --sents $s --json /tmp/z3/w3b_$(basename $tree)_${s}_$r.json 2>&1 | grep 'peak '
  done
done; done
