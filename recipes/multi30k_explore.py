"""Multi30k en->de: which model and dropout converge best on val (docs/multi30k_converged.md).

Every configuration trains at the same time on one GPU for the same wall time, then the average of
its last 5 checkpoints is scored on val (beam 4, alpha 0.6): sacreBLEU cased and lowercased. Test is
never touched. Run from the repository root with the package importable and a prepared Multi30k
in data/m30k (`transformer prepare multi30k --src en --tgt de --from ../shared/data/multi30k
--out data/m30k`):

    OUT=results/ python recipes/multi30k_explore.py          # all configurations, on CUDA
    SWEEP_DEVICE=cpu SWEEP_REHEARSAL=1 OUT=/tmp/x python recipes/multi30k_explore.py  # a dry run
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path("/tmp/sweep")
WORK.mkdir(parents=True, exist_ok=True)
DATA = "data/m30k"
DEVICE = os.environ.get("SWEEP_DEVICE", "cuda")
REHEARSAL = os.environ.get("SWEEP_REHEARSAL")
COMMON = [
    "train.dtype=bf16",
    "train.max_tokens=4000",
    "train.max_steps=6000",
    "train.max_minutes=6.0",
    "train.save_every_steps=200",
    "train.save_every_minutes=1000",
    "train.keep_last=5",
    "train.valid_every_steps=1000",
    "train.log_every_steps=100",
    "train.warmup_steps=800",
    "train.lr_scale=0.5",
]


def M(n: int, d: int, ff: int, h: int) -> list[str]:  # noqa: N802
    """The model overrides of N layers of width d (d_ff ff, h heads of d / h)."""
    return [
        f"model.n_layers={n}",
        f"model.d_model={d}",
        f"model.d_ff={ff}",
        f"model.n_heads={h}",
        f"model.d_k={d // h}",
        f"model.d_v={d // h}",
    ]


CONFIGS = {
    "A_3x256_p01": M(3, 256, 1024, 4) + ["model.p_drop=0.1"],
    "B_3x256_p03": M(3, 256, 1024, 4) + ["model.p_drop=0.3"],
    "C_6x256_p03": M(6, 256, 1024, 4) + ["model.p_drop=0.3"],
    "D_4x256_p03_a01": M(4, 256, 1024, 4) + ["model.p_drop=0.3", "model.p_attn_drop=0.1"],
    "E_3x512_p03": M(3, 512, 2048, 8) + ["model.p_drop=0.3"],
    "F_4x128_p03": M(4, 128, 512, 4) + ["model.p_drop=0.3"],
}


def one(name: str) -> dict:
    import sacrebleu

    from transformer.config import build_config
    from transformer.data import load_prepared
    from transformer.rundir import average_run, read_metrics
    from transformer.train import train
    from transformer.translate import Translator

    run = Path(f"/tmp/runs/{name}")
    t0 = time.time()
    extra = ["train.max_steps=12", "train.save_every_steps=2"] if REHEARSAL else []
    train(
        DATA,
        run,
        build_config("quickstart", None, COMMON + CONFIGS[name] + extra),
        device=DEVICE,
        progress=False,
        threads=1,
    )
    train_s = time.time() - t0
    data = load_prepared(DATA)
    val = data.split("valid")
    src, refs = val.text("en"), val.text("de")
    if REHEARSAL:
        src, refs = src[:20], refs[:20]
    tr = Translator.from_path(average_run(run, 5), device=DEVICE)
    hyps = tr.translate_lines(src)
    (WORK / f"{name}.val.hyp").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    last = [r for _, r in read_metrics(run, "train")][-1]
    return {
        "val_bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
        "val_bleu_lc": round(sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score, 2),
        "steps": last["step"],
        "epochs": round(last["tokens"] / int(data.split("train").tgt_lens.sum()), 1),
        "train_s": round(train_s),
        "eval_s": round(time.time() - t0 - train_s),
        "params": tr.model.num_parameters(),
        "valid_curve": [
            (r["step"], round(r["ppl"], 3), round(r.get("bleu", -1), 2))
            for _, r in read_metrics(run, "valid")
        ],
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        name = sys.argv[2]
        try:
            res = one(name)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res = {"error": repr(e)}
        (WORK / f"{name}.json").write_text(json.dumps(res))
        print(name, json.dumps(res), flush=True)
        sys.exit(0)
    start = time.time()
    procs = {}
    for name in CONFIGS:
        log = open(WORK / f"{name}.log", "w")
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--one", name],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    for p in procs.values():
        p.wait()
    results = {
        n: json.loads((WORK / f"{n}.json").read_text()) if (WORK / f"{n}.json").exists() else None
        for n in CONFIGS
    }
    with open(OUT / "all.log", "w") as f:
        for n in CONFIGS:
            for src in (WORK / f"{n}.log", Path(f"/tmp/runs/{n}/train.log")):
                if src.exists():
                    f.write(f"==== {src}\n" + "\n".join(src.read_text().splitlines()[-60:]) + "\n")
    (OUT / "m30k_sweep.json").write_text(json.dumps(results, indent=1))
    print(f"all done in {time.time() - start:.0f} s")
    for n, r in results.items():
        print(
            n,
            r
            and {
                k: r.get(k)
                for k in (
                    "val_bleu",
                    "val_bleu_lc",
                    "steps",
                    "epochs",
                    "train_s",
                    "eval_s",
                    "params",
                    "error",
                )
            },
        )
