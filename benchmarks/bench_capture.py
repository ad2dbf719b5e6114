"""Overhead of vitlab.models.capture / record_attention against a plain forward of the same model.

Run: ``python benchmarks/bench_capture.py [--model vit_small_patch16_224] [--batch 8] [--repeats 5]``.
Times are the median of interleaved repeats in one process (CPU, float32, no grad, random init).
``record_attention`` forces timm's explicit attention path, so it is also compared with a plain forward
on that path ("explicit"), which isolates the cost of recording from the cost of not using the fused kernel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vitlab.models import build_model, capture, record_attention  # noqa: E402


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(args.model, 10, pretrained=False).eval()
    x = torch.randn(args.batch, 3, 224, 224)
    attention_modules = [m for m in model.modules() if hasattr(m, "fused_attn")]

    def plain():
        model(x)

    def explicit():
        flags = [m.fused_attn for m in attention_modules]
        for m in attention_modules:
            m.fused_attn = False
        try:
            model(x)
        finally:
            for m, flag in zip(attention_modules, flags):
                m.fused_attn = flag

    def capture_attn_mlp():
        with capture(model, ["attn", "mlp"]):
            model(x)

    def capture_all_fp16():
        with capture(model, ["qkv_input", "attn", "mlp_hidden", "mlp", "resid"], dtype=torch.float16):
            model(x)

    def record():
        with record_attention(model):
            model(x)

    cases = {"plain": plain, "explicit": explicit, "capture attn+mlp": capture_attn_mlp,
             "capture 5 sites fp16": capture_all_fp16, "record_attention": record}
    with torch.no_grad():
        for fn in cases.values():  # warm-up
            fn()
        times = {name: [] for name in cases}
        for _ in range(args.repeats):  # interleave to share the machine's noise
            for name, fn in cases.items():
                times[name] += _time(fn, 1)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.repeats} repeats (median)")
    print(f"{'case':<24}{'seconds':>10}{'/ plain':>10}{'/ explicit':>12}")
    for name, seconds in medians.items():
        print(f"{name:<24}{seconds:>10.3f}{seconds / medians['plain']:>10.3f}{seconds / medians['explicit']:>12.3f}")


if __name__ == "__main__":
    main()
