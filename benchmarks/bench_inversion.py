"""Cost of one inversion step (vitlab.analysis.inversion.invert) against a bare forward + backward.

Run: ``python benchmarks/bench_inversion.py [--model vit_small_patch16_224] [--layer 3] [--batch 1] [--steps 8]``.
The bare step is ``forward_until(model, x, layer)`` + ``backward`` to the input. One inversion step is isolated as
``(time of invert(steps=K) - time of invert(steps=0)) / K`` (the difference cancels the target forward, the noise
baseline and the final evaluation). Medians of interleaved repeats in one process (float32, random init; CUDA when
available and not --cpu). Target: ratio <= 1.15.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vitlab.analysis.inversion import invert, with_normalization  # noqa: E402
from vitlab.models import build_model, forward_until, input_size, normalization  # noqa: E402
from vitlab.models.testing import randomize_parameters  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--layer", type=int, default=3, help="invert the output of this block")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8, help="K: steps per timed inversion")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    model = randomize_parameters(build_model(args.model, 10), seed=0, scale=0.02).eval().to(device)
    for param in model.parameters():
        param.requires_grad_(False)  # inversion only needs input gradients
    pixels = torch.rand(args.batch, *input_size(model), generator=torch.Generator().manual_seed(0)).to(device)
    features = with_normalization(lambda x: forward_until(model, x, args.layer), *normalization(model))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def bare() -> None:
        for _ in range(args.steps):
            x = pixels.clone().requires_grad_(True)
            forward_until(model, x, args.layer).sum().backward()

    def inversion(steps: int):
        return lambda: invert(features, pixels, steps=steps, early_stop=False, noise_draws=1,
                              generator=torch.Generator().manual_seed(0))

    cases = {"bare x K": bare, "invert(K)": inversion(args.steps), "invert(0)": inversion(0)}
    for fn in cases.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved, so the machine's noise is shared
        for name, fn in cases.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    bare_step = median["bare x K"] / args.steps
    invert_step = (median["invert(K)"] - median["invert(0)"]) / args.steps
    print(f"{args.model}, inverting block {args.layer}, batch {args.batch}, K={args.steps} steps, {device}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved repeats")
    print(f"  bare forward_until + backward : {bare_step * 1e3:8.2f} ms/step")
    print(f"  one inversion step            : {invert_step * 1e3:8.2f} ms/step  "
          "(Adam + cosine + clamp + TV + normalisation + bookkeeping)")
    print(f"  ratio inversion / bare        : {invert_step / bare_step:8.3f}   (target <= 1.15)")


if __name__ == "__main__":
    main()
