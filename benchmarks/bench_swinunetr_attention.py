"""Attention recording and sliding-window validation on MONAI's SwinUNETR, each against the bare call, side by side.

Goals:
    (a) a forward inside ``vitlab.models.record_attention`` (every window-attention block of the Swin encoder)
        <= 1.2x a plain forward of the same model and input, both under ``torch.no_grad`` in eval mode; on the
        quickstart's tiny SwinUNETR (32^3, feature size 12, batch 2) and a medium one (64^3, feature size 24,
        batch 1);
    (b) vitlab's sliding-window validation (``SegmentationModule.predict_logits``, window 32^3, overlap 0.25) on a
        64^3 volume at least 0.9x the speed of MONAI's ``sliding_window_inference`` called directly with the
        same arguments on the same model and volume (printed: MONAI time / vitlab time).

Times are the fastest of ``--repeats`` interleaved rounds (CPU, float32, random init).

    python benchmarks/bench_swinunetr_attention.py [--repeats 5] [--volume 64] [--window 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from monai.inferers import sliding_window_inference

from vitlab.models import build_model, record_attention
from vitlab.training.segmentation import SegmentationModule

SIZES = {
    "tiny": ({"img_size": 32, "feature_size": 12, "depths": (2, 2, 2, 2), "num_heads": (3, 6, 12, 24), "norm_name": "batch"}, 2),
    "medium": ({"img_size": 64, "feature_size": 24, "depths": (2, 2, 2, 2), "num_heads": (3, 6, 12, 24), "norm_name": "batch"}, 1),
}


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Fastest wall time of each function over ``repeats`` rounds that run them one after the other (one warm-up
    round first), so load on the shared machine hits both alike."""
    best = {name: float("inf") for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--volume", type=int, default=64, help="side of the volume for (b)")
    parser.add_argument("--window", type=int, default=32, help="sliding window side for (b) (the tiny model's img_size)")
    parser.add_argument("--overlap", type=float, default=0.25)
    args = parser.parse_args()
    print(f"torch threads = {torch.get_num_threads()}")

    print("\n(a) record_attention vs a plain forward (no_grad, eval)")
    for label, (kwargs, batch) in SIZES.items():
        torch.manual_seed(0)
        model = build_model("monai:swin_unetr", 2, in_chans=1, **kwargs).eval()
        side = kwargs["img_size"]
        volume = torch.randn(batch, 1, side, side, side)
        recorded = {}

        def plain(model=model, volume=volume) -> None:
            with torch.no_grad():
                model(volume)

        def record(model=model, volume=volume, recorded=recorded) -> None:
            with torch.no_grad(), record_attention(model) as rec:
                model(volume)
            recorded["attentions"] = rec.attentions

        times = interleaved({"plain": plain, "record": record}, args.repeats)
        attentions = recorded["attentions"]
        mib = sum(t.numel() * t.element_size() for t in attentions.values()) / 2**20
        print(f"  {label:6s} {side}^3, feature size {kwargs['feature_size']}, batch {batch}: plain {times['plain']:.3f} s, "
              f"record_attention {times['record']:.3f} s ({len(attentions)} blocks, {mib:.1f} MiB of probabilities)"
              f"  ->  {times['record'] / times['plain']:.2f}x  (goal <= 1.2x)")

    print(f"\n(b) sliding-window validation: {args.volume}^3 volume, window {args.window}^3, overlap {args.overlap}, "
          f"sw_batch_size 4, gaussian")
    torch.manual_seed(0)
    module = SegmentationModule(num_classes=1, model_name="monai:swin_unetr", in_chans=1,
                                model_kwargs={**SIZES["tiny"][0], "img_size": args.window},
                                sliding_window=[args.window] * 3, sliding_overlap=args.overlap).eval()
    volume = torch.randn(1, 1, args.volume, args.volume, args.volume)
    window = (args.window,) * 3
    outputs = {}

    def vitlab_loop() -> None:
        with torch.no_grad():
            outputs["vitlab"] = module.predict_logits(volume)

    def monai_loop() -> None:
        with torch.no_grad():
            outputs["monai"] = sliding_window_inference(volume, window, sw_batch_size=4, predictor=module.model,
                                                        overlap=args.overlap, mode="gaussian")

    times = interleaved({"monai": monai_loop, "vitlab": vitlab_loop}, args.repeats)
    same = torch.equal(outputs["vitlab"], outputs["monai"])
    print(f"  MONAI sliding_window_inference {times['monai']:.3f} s, vitlab predict_logits {times['vitlab']:.3f} s "
          f"(same logits: {same})  ->  speed {times['monai'] / times['vitlab']:.2f}x MONAI's  (goal >= 0.9x)")


if __name__ == "__main__":
    main()
