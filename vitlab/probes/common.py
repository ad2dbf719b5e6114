"""What every ``probe.py`` subcommand shares: the arguments, the context it runs in, output folder, progress, Ctrl-C.

A subcommand is a module in :mod:`vitlab.probes` with ``HELP`` (one line + example), ``add_arguments(parser)``
and ``run(ctx: ProbeContext) -> None``; it reads models and images through the context and writes through
``ctx.writer`` (TensorBoard) and :mod:`vitlab.outputs.files` (tables) into ``ctx.out``. The model comes from
:mod:`vitlab.probes.loading` (a run opened by :mod:`vitlab.runs`), its images and volumes from
:mod:`vitlab.probes.streams`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from vitlab.probes.loading import LoadedModel, load_model
from vitlab.probes.streams import ImageBatch, ImageStream, image_stream, load_images

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- arguments


def add_common_arguments(parser: argparse.ArgumentParser, images: bool = True, model: bool = True) -> None:
    """Arguments every subcommand shares (model source, images, output, seed, device)."""
    if model:
        src = parser.add_argument_group("model (one of --checkpoint, --config, --model)")
        add_model_arguments(src)
    if images:
        img = parser.add_argument_group("images")
        img.add_argument("--images", nargs="+", metavar="PATH", help="image files or folders (DICOM/PNG/JPEG/TIFF); default: validation images of --config's data, else of the embedded dataset")
        img.add_argument("--num-images", type=int, default=None, help="how many images to use (default: the subcommand's own)")
        img.add_argument("--split", default="val", choices=["train", "val", "test"], help="split of the data section / embedded dataset to draw images from")
        img.add_argument("--spacing", type=float, nargs=3, metavar="MM", default=None, help="3-D models: resample each volume to this voxel size in mm along i, j, k (default: the config's data.spacing, else each volume's own)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="output folder (default runs/probe-<subcommand>-<name>/): TensorBoard events + CSV/JSON tables")
    out.add_argument("--overwrite", action="store_true", help="replace the results already in --out")
    out.add_argument("--seed", type=int, default=0)
    out.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")


def add_model_arguments(group, prefix: str = "") -> None:
    """--checkpoint / --config / --model [--pretrained | --weights] (optionally prefixed, e.g. ``second-``)."""
    dash = f"--{prefix}"
    group.add_argument(f"{dash}checkpoint", type=Path, default=None, help="a vitlab training checkpoint (.ckpt): architecture and weights")
    group.add_argument(f"{dash}config", type=Path, default=None, help="a training config (e.g. runs/x/version_0/config.yaml): architecture and data; weights from its checkpoints/last.ckpt when present")
    group.add_argument(f"{dash}model", default=None, help="a timm / torchvision model name, e.g. vit_base_patch32_224")
    group.add_argument(f"{dash}pretrained", action="store_true", help="with --model: the library's pretrained weights")
    group.add_argument(f"{dash}weights", type=Path, default=None, help="with --model: a local weights file")
    group.add_argument(f"{dash}model-kwargs", default=None, help='with --model: constructor arguments as JSON, e.g. \'{"img_size": 64}\'')
    group.add_argument(f"{dash}num-classes", type=int, default=None, help="with --model: classes of the head (default: the pretrained / weights head, else 2)")
    group.add_argument(f"{dash}in-chans", type=int, default=None, help="with --model: input channels (default 3)")


# ---------------------------------------------------------------------------------------------- output


def prepare_out(out: Path | None, subcommand: str, name: str, overwrite: bool) -> Path:
    """The output folder: created if new; an existing non-empty one needs --overwrite (old results removed)."""
    if out is None:
        safe = name.replace("/", "_").replace(":", "_")
        out = Path("runs") / f"probe-{subcommand}-{safe}"
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"--out {out} already holds results; pass --overwrite to replace them or choose another --out")
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


_OPEN_BARS: list[Any] = []  # the one progress bar on screen (tqdm), while a loop shows it


def progress(iterable: Iterable[T], desc: str, total: int | None = None) -> Iterator[T]:
    """One progress bar (tqdm, to stderr) around a long loop, and none when stderr is not a terminal.

    A loop inside a loop that shows the bar gets no bar of its own: its name and count go into the bar's postfix
    (at most twice a second). Nested tqdm bars draw with cursor-movement escapes, which in a log file are
    garbage lines; tqdm redraws fill a file with carriage returns, so a file gets no bar at all.
    """
    if _OPEN_BARS:
        yield from _in_postfix(_OPEN_BARS[-1], iterable, desc, total)
        return
    if not _is_terminal(sys.stderr):
        yield from iterable
        return
    from tqdm import tqdm

    bar = tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True, file=sys.stderr)
    _OPEN_BARS.append(bar)
    try:
        yield from bar
    finally:
        _OPEN_BARS.remove(bar)
        bar.close()


def _in_postfix(bar: Any, iterable: Iterable[T], desc: str, total: int | None) -> Iterator[T]:
    """The items of an inner loop, its progress written into the open ``bar``'s postfix."""
    shown = 0.0
    for count, item in enumerate(iterable, 1):
        now = time.monotonic()
        if now - shown >= 0.5:
            bar.set_postfix_str(f"{desc} {count}/{total}" if total else f"{desc} {count}")
            shown = now
        yield item
    bar.set_postfix_str("")


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@dataclass
class ProbeContext:
    """Everything a subcommand's ``run`` receives."""

    args: argparse.Namespace
    subcommand: str
    out: Path
    device: torch.device
    writer: Any  # torch.utils.tensorboard.SummaryWriter
    loaded: LoadedModel | None = None

    @property
    def model(self) -> nn.Module:
        assert self.loaded is not None, "this subcommand loads no model"
        return self.loaded.model

    def images(self, default_count: int, split: str | None = None, volumes: bool = False) -> ImageBatch:
        assert self.loaded is not None
        return load_images(self.args, self.loaded, default_count, split, volumes)

    def image_stream(self, default_count: int, split: str | None = None, volumes: bool = False) -> ImageStream:
        assert self.loaded is not None
        return image_stream(self.args, self.loaded, default_count, split, volumes)

    def load_second_model(self, prefix: str) -> LoadedModel:
        return load_model(self.args, prefix=prefix, device=str(self.device))
