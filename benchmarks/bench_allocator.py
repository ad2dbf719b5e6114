"""Training steps of the quickstart volume model with glibc's default ``malloc`` against vitlab's
:func:`vitlab.runtime.keep_freed_memory` (which ``train.py`` sets for runs on 3-D volumes), side by side in one run.

Each measurement is a fresh process (the allocator is set once torch is imported, before the model is built:
where ``train.py`` sets it) that builds the quickstart's SwinUNETR (``configs/quickstart_volume.yaml``'s
``model.model_kwargs``: 32^3, feature size 12), its AdamW and a batch of 2 random volumes, takes one warm-up
step and then times ``--steps`` training steps (forward, cross-entropy, backward, AdamW). The two settings
alternate ``--repeats`` times; printed per setting are the fastest wall time, the user and system CPU seconds of
that repeat and the peak resident memory, then the ratios.
Three models: the quickstart's SwinUNETR with MONAI's default 7^3 windows (as ``configs/medical_swinunetr.yaml``
and most SwinUNETR users train; 16^3 tokens padded to 21^3: attention tensors of tens of MB), the quickstart's
own (4^3 windows: small tensors) and the 2-D quickstart's Swin (``configs/quickstart.yaml``).

Goal: the 7^3-window step spends far less of its CPU time in the kernel (page faults of memory freed and mapped
again every step) and takes less time; the others are no slower.

    python benchmarks/bench_allocator.py [--steps 10] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

_STEPS = r"""
import json, os, resource, sys, time
mode, model, steps, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch
from vitlab.runtime import keep_freed_memory
kept = keep_freed_memory() if mode == "kept" else False  # (after torch is imported, before the model: as train.py sets it)
import torch.nn.functional as F
from vitlab.models import build_model, build_segmenter
torch.set_num_threads(threads)
torch.manual_seed(0)
kwargs = json.loads(sys.argv[5])
if model == "3d":
    net = build_segmenter("monai:swin_unetr", num_classes=1, in_chans=1, pretrained=False, model_kwargs=kwargs)
    x, y = torch.randn(2, 1, 32, 32, 32), torch.randint(0, 2, (2, 32, 32, 32))
else:
    net = build_model(kwargs.pop("model_name"), num_classes=2, pretrained=False, **kwargs)
    x, y = torch.randn(32, 3, 64, 64), torch.randint(0, 2, (32,))
opt = torch.optim.AdamW(net.parameters(), 1e-3)

def step():
    loss = F.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

step()
t0, c0 = time.perf_counter(), os.times()
for _ in range(steps):
    step()
c1 = os.times()
print(json.dumps({"kept": kept, "wall": time.perf_counter() - t0, "user": c1.user - c0.user, "sys": c1.system - c0.system,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


VARIANTS = {  # name -> (model, model_kwargs overrides)
    "3-D, 7^3 windows (MONAI's default)": ("3d", {"window_size": 7}),
    "3-D quickstart (4^3 windows)": ("3d", {}),
    "2-D quickstart": ("2d", {}),
}


def model_kwargs(model: str, overrides: dict) -> dict:
    if model == "3d":
        config = yaml.safe_load((ROOT / "configs" / "quickstart_volume.yaml").read_text())
        return {**config["model"]["model_kwargs"], **overrides}
    config = yaml.safe_load((ROOT / "configs" / "quickstart.yaml").read_text())
    return {"model_name": config["model"]["model_name"], **config["model"].get("model_kwargs", {})}


def measure(mode: str, model: str, overrides: dict, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VITLAB_MALLOC"))}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _STEPS, mode, model, str(args.steps), str(args.threads),
                          json.dumps(model_kwargs(model, overrides))], env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    summary = []
    for name, (model, overrides) in VARIANTS.items():
        print(f"{name}, {args.steps} steps on {args.threads} thread(s):", flush=True)
        best: dict[str, dict] = {}
        for r in range(args.repeats):
            for mode in ("system", "kept"):
                result = measure(mode, model, overrides, args)
                print(f"  repeat {r + 1} {mode:6s}: {result['wall']:.2f} s wall, {result['user']:.2f} s user, "
                      f"{result['sys']:.2f} s sys, peak {result['rss_mb']:.0f} MB", flush=True)
                if mode not in best or result["wall"] < best[mode]["wall"]:
                    best[mode] = result
        summary.append((name, best["system"], best["kept"]))
    print(f"\nfastest of {args.repeats}; kernel share = system / (user + system) CPU seconds")
    print(f"  {'model':38s} {'glibc default':>24s} {'keep_freed_memory':>24s} {'time ratio':>11s} {'peak memory':>12s}")
    for name, s, k in summary:
        cells = [f"{b['wall']:6.2f} s, {b['sys'] / max(b['user'] + b['sys'], 1e-9):5.1%} kernel" for b in (s, k)]
        print(f"  {name:38s} {cells[0]:>24s} {cells[1]:>24s} {k['wall'] / s['wall']:10.2f}x "
              f"{k['rss_mb'] / s['rss_mb']:11.2f}x")


if __name__ == "__main__":
    main()
