import sys, json
sys.path[:0] = ["/work/shared/peers", "/work/main/benchmarks"]
def hwm():
    d = {}
    for l in open("/proc/self/status"):
        if l.startswith(("VmHWM", "VmRSS")):
            d[l.split(":")[0]] = int(l.split()[1]) // 1024
    return f"rss {d['VmRSS']} hwm {d['VmHWM']}"
import torch
from common import make_mt_batch, setup_threads
from train_adapters import PAPER_BASE, get_adapter
setup_threads(2)
cfg = dict(PAPER_BASE)
batch = make_mt_batch(128, 30, 30, 4, cfg["vocab"], seed=0)
ad = get_adapter("ext:peers_adapter:make_train", cfg)
prep = ad.prepare(batch)
ad.step(ad.prepare(make_mt_batch(2, 30, 30, 4, cfg["vocab"], seed=1)), None)
print("after prime", hwm())
model, opt = ad.runs["fp32"]
model.register_forward_hook(lambda m, i, o: print("  end forward", hwm()))
orig = opt.step
def step(*a, **k):
    print("  before opt.step", hwm()); r = orig(*a, **k); print("  after opt.step", hwm()); return r
opt.step = step
ad.step(prep, None)
print("end", hwm())
