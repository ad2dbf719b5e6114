"""Helper of bench_probe_memory.py: the estimation phase of ``probe.py mi`` alone at a given N.

Builds ViT-B/16 (random weights: the recording phase's memory does not depend on N, the estimation phase's
does), fills the neuron store with N random fp16 rows per (block, site) of the shapes the probe keeps, and runs
the probe's own ``estimate_all`` on it; the caller reads this process's peak RSS.
Run: ``python benchmarks/_mi_estimation_phase.py N OUT_DIR``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter

from vitlab import models
from vitlab.probes.common import ProbeContext
from vitlab.probes.mi import NeuronStore, add_arguments, default_bins, estimate_all


def main() -> None:
    count, out = int(sys.argv[1]), Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    model = models.build_model("vit_base_patch16_224", 2, in_chans=3).eval()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    args.bins = default_bins(count)
    views, sites = models.select_blocks(model, None), ["attn", "mlp"]
    kept = args.centre_channels + args.cross_channels
    generator = torch.Generator().manual_seed(0)
    writer = SummaryWriter(str(out))
    ctx = ProbeContext(args=args, subcommand="mi", out=out, device=torch.device("cpu"), writer=writer, loaded=None)
    with tempfile.TemporaryDirectory(dir=out) as spill, NeuronStore(Path(spill), count) as neurons:
        for view in views:
            tokens = view.grid[0] * view.grid[1]
            for site in sites:
                keep = torch.randperm(view.dim, generator=generator)[:kept].sort().values
                neurons.add((view.name, site), tokens, keep)
                for start in range(0, count, args.batch_size):
                    rows = min(args.batch_size, count - start)
                    neurons.write((view.name, site), start, torch.randn(rows, tokens, kept, generator=generator).half())
        estimate_all(ctx, neurons, {view.name: tuple(view.grid) for view in views}, views, sites, count)
    writer.close()


if __name__ == "__main__":
    main()
