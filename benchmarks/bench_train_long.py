"""Training at the lengths people train at: a 4-layer V4-Flash-WIDTH transformers
DeepseekV4ForCausalLM (layers CSA, HCA, window, CSA; hidden 4096, 64 heads x 512, the
V4-Flash indexer and compressors; few experts: 4 routed of 512 with 2 active + 1 shared,
a byte vocabulary of 256), swapped onto deepseek_csa (``deepseek_csa.transformers.swap``),
trained with AdamW for ``--steps`` steps on windows of ``--seq`` bytes of this repository's
own documentation (README.md and docs/*.md: real text, so the loss has something to
learn).  One process, float32 (or ``--dtype bfloat16``) throughout.

Per step: the LM loss, the step's wall and CPU seconds, and the process's resident
high-water mark (the peak of the whole run so far: weights, gradients, AdamW moments and
the activations of the step).  ``--checkpoint`` recomputes each decoder layer in the
backward (transformers' gradient checkpointing) instead of keeping its activations.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_train_long.py               # S=4096, 20 steps
    .venv/bin/python benchmarks/bench_train_long.py --seq 512 --steps 3 --out /tmp/t.json   # a check

Writes benchmarks/results/train_long.json and train_long.png (loss curve, step time,
memory) after every step.  Not part of run.py (one long run, ~1 h on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from bench_hf import flash_config  # noqa: E402
from harness import RESULTS, environment  # noqa: E402

KINDS = {"csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention",
         "window": "sliding_attention"}


def corpus() -> torch.Tensor:
    """The repository's own prose as bytes (token = byte value)."""
    root = HERE.parent
    files = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    data = b"\n\n".join(f.read_bytes() for f in files if f.exists())
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def build(layers: str, seed: int):
    from transformers import DeepseekV4ForCausalLM
    cfg = flash_config(layer_types=[KINDS[k] for k in layers.split(",")], vocab=256)
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, 65536)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():      # transformers starts sinks and position biases at zero
        for name, p in model.named_parameters():
            if name.endswith("position_bias") or name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _hwm_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plot(out: dict, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = out["steps"]
    k = [s["step"] for s in steps]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    a.plot(k, [s["loss"] for s in steps], "o-")
    a.set_xlabel("AdamW step")
    a.set_ylabel("LM loss (nats / byte)")
    a.set_title("loss")
    b.plot(k, [s["wall_s"] for s in steps], "o-", label="wall")
    b.plot(k, [s["cpu_s"] for s in steps], "s--", label="CPU / threads")
    b.set_xlabel("step")
    b.set_ylabel("seconds")
    b.set_title("step time")
    b.legend()
    c.plot(k, [s["peak_rss_bytes"] / 2**30 for s in steps], "o-")
    c.axhline(24, color="r", lw=0.8, ls=":")
    c.set_xlabel("step")
    c.set_ylabel("GiB")
    c.set_title("resident high-water mark (24 GiB machine)")
    e = out["environment"]
    fig.suptitle(f"{out['model']}, S={out['seq']}, swapped onto deepseek_csa "
                 f"({e['cpu']}, {e['isa']}, {e['threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", default="csa,hca,window,csa")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="parameters, activations and AdamW moments in this dtype")
    ap.add_argument("--checkpoint", action="store_true",
                    help="recompute each decoder layer in the backward")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import deepseek_csa.transformers as dch
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    torch.set_num_threads(threads)
    out_path = Path(a.out or RESULTS / "train_long.json")

    text = corpus()
    if text.numel() < a.seq + 1:
        sys.exit(f"bench_train_long: the corpus has {text.numel()} bytes, fewer than "
                 f"--seq {a.seq} + 1")
    model = build(a.layers, a.seed)
    model.to(getattr(torch, a.dtype))
    dch.swap(model)
    model.train()
    if a.checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    pick = torch.Generator().manual_seed(a.seed + 7)
    import transformers
    out = {"environment": dict(environment(threads), transformers=transformers.__version__),
           "model": f"4-layer V4-Flash-width DeepseekV4ForCausalLM ({a.layers}), "
                    f"{n_params / 1e6:.0f}M parameters, {a.dtype}",
           "parameters": n_params, "dtype": a.dtype, "layers": a.layers, "seq": a.seq, "lr": a.lr,
           "checkpoint": a.checkpoint, "corpus_bytes": int(text.numel()),
           "rss_before_bytes": _hwm_bytes(), "steps": []}
    print(f"{out['model']}; corpus {text.numel()} bytes; S={a.seq}", flush=True)
    for step in range(1, a.steps + 1):
        start = int(torch.randint(0, text.numel() - a.seq, (1,), generator=pick))
        ids = text[start:start + a.seq][None]
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        row = {"step": step, "loss": float(loss.detach()),
               "wall_s": time.perf_counter() - t0,
               "cpu_s": (time.process_time() - c0) / threads,
               "peak_rss_bytes": _hwm_bytes(), "load_average": os.getloadavg()}
        out["steps"].append(row)
        print(f"step {step:3d} loss {row['loss']:.4f}  {row['wall_s']:7.1f} s  "
              f"peak {row['peak_rss_bytes'] / 2**30:5.2f} GiB  load {row['load_average'][0]:.1f}",
              flush=True)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(out, indent=1))
        plot(out, out_path.with_suffix(".png"))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
