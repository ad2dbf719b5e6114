"""Overhead of vitlab.models.capture / record_attention against a plain forward of the same model, per family.

Run: ``python benchmarks/bench_capture.py [--model NAME [NAME ...]] [--batch 8] [--repeats 5]``; the default
models are one per family added for Swin V2 / Eva / BEiT / ViT-RelPos plus timm ViT as the reference, each
at its native input size. Times are the minimum of interleaved repeats in one process (CPU, float32, no
grad, random init; on a shared machine the minimum is the least noisy estimate, and only ratios matter). ``record_attention`` forces timm's explicit
attention path, so it is also compared with a plain forward on that path ("explicit"), which isolates the
cost of recording from the cost of not using the fused kernel. The target is <= 1.10x for ``capture`` and
for ``record_attention`` / explicit.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vitlab.models import build_model, capture, family_name, input_size, record_attention  # noqa: E402

DEFAULT_MODELS = ["vit_small_patch16_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224", "swin_v2_t",
                  "eva02_tiny_patch14_224", "beit_base_patch16_224", "vit_relpos_small_patch16_224"]
TARGET = 1.10


def _time(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_model(name: str, batch: int, repeats: int) -> dict[str, float]:
    """Fastest seconds of each case for one model (cases interleaved to share the machine's noise)."""
    torch.manual_seed(0)
    model = build_model(name, 10, pretrained=False).eval()
    x = torch.randn(batch, *input_size(model))
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
        times = {case: [] for case in cases}
        for _ in range(repeats):
            for case, fn in cases.items():
                times[case] += _time(fn, 1)
    best = {case: min(values) for case, values in times.items()}
    print(f"\n{name} ({family_name(model)}), input {tuple(x.shape)}, {torch.get_num_threads()} threads, "
          f"{repeats} repeats (minimum)")
    print(f"{'case':<24}{'seconds':>10}{'/ plain':>10}{'/ explicit':>12}")
    for case, seconds in best.items():
        print(f"{case:<24}{seconds:>10.3f}{seconds / best['plain']:>10.3f}{seconds / best['explicit']:>12.3f}")
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=DEFAULT_MODELS, help="one or more model names")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    summary = {name: bench_model(name, args.batch, args.repeats) for name in args.model}
    print(f"\nsummary (ratios; target <= {TARGET:.2f}x): capture / plain, record_attention / explicit, "
          "record_attention / plain")
    for name, best in summary.items():
        ratios = (best["capture attn+mlp"] / best["plain"], best["record_attention"] / best["explicit"],
                  best["record_attention"] / best["plain"])
        flag = "ok" if max(ratios[:2]) <= TARGET else "over"
        print(f"{name:<32}" + "".join(f"{ratio:>8.3f}" for ratio in ratios) + f"  {flag}")


if __name__ == "__main__":
    main()
