"""What every ``probe.py`` subcommand shares: model loading, images, output folder, progress, Ctrl-C.

A subcommand is a module in :mod:`vitlab.probes` with ``HELP`` (one line + example), ``add_arguments(parser)``
and ``run(ctx: ProbeContext) -> None``; it reads models and images through the context and writes through
``ctx.writer`` (TensorBoard) and :mod:`vitlab.outputs.files` (tables) into ``ctx.out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from vitlab import models

T = TypeVar("T")
IMAGE_SUFFIXES = {".dcm", ".dicom", ".png", ".jpg", ".jpeg", ".tif", ".tiff"}


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


# ---------------------------------------------------------------------------------------------- models


@dataclass
class LoadedModel:
    """A model ready for probing plus where it came from."""

    model: nn.Module
    name: str
    source: str
    build: dict[str, Any] = field(default_factory=dict)  # build_model arguments (to make a fresh copy)
    data: dict[str, Any] | None = None  # the training config's data section, when known
    class_names: list[str] | None = None  # names of the head's outputs, when the checkpoint knows them
    run: str | None = None  # "<name>-<version>" when the checkpoint lives in a run folder (names the output folder)
    task: str = "classification"  # "detection" / "segmentation": a dense checkpoint's backbone in a fresh classifier,
    # or (a 3-D segmenter such as monai:swin_unetr) the whole network, whose outputs are voxel logits, not classes
    hparams: dict[str, Any] = field(default_factory=dict)  # the training checkpoint's hyperparameters (e.g. sliding_window)

    @property
    def head_trained(self) -> bool:
        """False for a detection / segmentation checkpoint: the classifier head around its backbone is untrained."""
        return self.task == "classification"

    def untrained_head(self, what: str) -> str:
        """One line saying why ``what`` (a use of the classifier head's outputs) is not done for this model."""
        return (f"{what}: {self.source} is a {self.task} checkpoint; its backbone is probed inside a classifier whose "
                "head is freshly initialised (untrained), so its class outputs mean nothing")

    def fresh(self, seed: int = 0) -> nn.Module:
        """An untrained model of the same architecture (for transplant / untrained baselines)."""
        torch.manual_seed(seed)
        args = {k: v for k, v in self.build.items() if k not in ("weights", "pretrained")}
        return models.build_model(**args).eval()


def _lightning_hparams(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise FileNotFoundError(f"--checkpoint {path}: no such file")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file ends in one line
        raise ValueError(f"--checkpoint {path}: not a readable torch checkpoint ({type(err).__name__}: {err})") from None
    hp = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not hp or "model_name" not in hp:
        raise ValueError(f"--checkpoint {path}: not a vitlab training checkpoint (no model hyperparameters); use --model NAME --weights {path}")
    return hp, ckpt["state_dict"]


def load_model(args: argparse.Namespace, prefix: str = "", device: str = "cpu") -> LoadedModel:
    """Build the model named by --checkpoint / --config / --model (with the given option prefix)."""
    get = lambda key: getattr(args, f"{prefix}{key}".replace("-", "_"), None)  # noqa: E731
    checkpoint, config, name = get("checkpoint"), get("config"), get("model")
    flag = f"--{prefix}"
    if sum(x is not None for x in (checkpoint, name)) > 1:
        raise ValueError(f"give one of {flag}checkpoint or {flag}model, not both")
    data = None
    if config is not None:
        cfg = _read_config(config)
        data = cfg.get("data") or {}
        if checkpoint is None and name is None:
            last = config.parent / "checkpoints" / "last.ckpt"
            if last.is_file():
                checkpoint = last
            else:
                hp = cfg.get("model") or {}
                kwargs = dict(hp.get("model_kwargs") or {})
                if cfg.get("task") in ("detection", "segmentation") and "img_size" not in kwargs:  # its backbone's input
                    kwargs["img_size"] = hp.get("image_size") or data.get("image_size") or 224
                build = dict(name=hp.get("model_name"), num_classes=_num_classes(data), in_chans=data.get("in_chans", 1), **kwargs)
                model = models.build_model(**build)
                return LoadedModel(_prepare(model, hp.get("ablate"), device), str(build["name"]), f"{config} (untrained: no checkpoints/last.ckpt beside it)", build, data)
    if checkpoint is not None:
        hp, state = _lightning_hparams(Path(checkpoint))
        run_config = Path(checkpoint).resolve().parent.parent / "config.yaml"  # runs/<name>/<version>/checkpoints/x.ckpt
        if data is None and Path(checkpoint).resolve().parent.name == "checkpoints" and run_config.is_file():
            data = _read_config(run_config).get("data") or {}  # images default to the run's own data
        kwargs = dict(hp.get("model_kwargs") or {})
        task = checkpoint_task(state)
        whole = task == "classification" and "sliding_window" in hp  # a segmenter probed whole (MONAI's SwinUNETR / UNETR)
        if "image_size" in hp and "img_size" not in kwargs:  # a detector / segmenter: probe its backbone
            kwargs["img_size"] = hp["image_size"]
        classes = hp.get("num_classes", 2) + 1 if whole else max(hp.get("num_classes", 2), 2)  # (background; DINO: 0)
        build = dict(name=hp["model_name"], num_classes=classes, in_chans=hp.get("in_chans", 1), **kwargs)
        model = models.build_model(**build)
        models.load_weights(model, state)
        task = "segmentation" if whole else task
        names = hp.get("class_names") if task == "classification" else None  # a dense model's classes are not the head's
        return LoadedModel(_prepare(model, hp.get("ablate"), device), str(hp["model_name"]), str(checkpoint), build, data,
                           list(names) if names else None, run_label(Path(checkpoint)), task, dict(hp))
    if name is None:
        raise ValueError(f"no model given: use {flag}checkpoint PATH.ckpt, {flag}config RUN/config.yaml or {flag}model NAME [{flag}pretrained | {flag}weights FILE]")
    kwargs = json.loads(get("model_kwargs")) if get("model_kwargs") else {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{flag}model-kwargs must be a JSON object, got {get('model_kwargs')!r}")
    build = dict(name=name, num_classes=get("num_classes") or (1000 if get("pretrained") else 2), in_chans=get("in_chans") or 3,
                 pretrained=bool(get("pretrained")), weights=str(get("weights")) if get("weights") else None, **kwargs)
    try:
        model = models.build_model(**build)
    except models.PretrainedWeightsUnavailable as err:
        reason = getattr(err, "reason", None) or str(err)
        raise models.PretrainedWeightsUnavailable(
            f"{flag}pretrained: weights for {name!r} are not available ({reason}); pass {flag}weights FILE "
            f"(a timm/torchvision state_dict, .safetensors file or vitlab checkpoint) instead, or drop {flag}pretrained "
            "to probe an untrained model") from None
    return LoadedModel(_prepare(model, None, device), name, str(get("weights") or ("pretrained" if get("pretrained") else "untrained")), build, data)


def checkpoint_task(state: dict[str, torch.Tensor]) -> str:
    """``detection`` / ``segmentation`` for a vitlab dense checkpoint's state dict (its backbone sits under
    ``model.backbone.body.``; a detector has a region proposal network), else ``classification``."""
    # vitlab.models.dense.BACKBONE_PREFIX, spelled out: importing it would load torchvision's detection (slow start-up)
    if not any(key.startswith("model.backbone.body.") for key in state):
        return "classification"
    return "detection" if any(key.startswith("model.rpn.") for key in state) else "segmentation"


def run_label(checkpoint: Path) -> str | None:
    """``runs/quickstart/version_0/checkpoints/last.ckpt`` -> ``"quickstart-version_0"`` (None outside a run folder)."""
    path = Path(checkpoint).resolve()
    if path.parent.name != "checkpoints" or not (path.parent.parent / "config.yaml").is_file():
        return None
    version = path.parent.parent
    return f"{version.parent.name}-{version.name}"


def newest_checkpoint(runs: Path = Path("runs")) -> Path:
    """The newest ``runs/**/checkpoints/last.ckpt`` by modification time (the default model of every probe)."""
    found = sorted(Path(runs).glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime) if Path(runs).is_dir() else []
    if not found:
        raise FileNotFoundError(
            f"no model given and no trained run in {runs}/ (no {runs}/**/checkpoints/last.ckpt): train one first with "
            "`python train.py --config configs/quickstart.yaml`, or name a model with --checkpoint, --config or --model")
    return found[-1]


def _prepare(model: nn.Module, ablate: dict[str, Any] | None, device: str) -> nn.Module:
    if ablate:
        models.ablate(model, **ablate)
    return model.to(device).eval()


def _read_config(path: Path) -> dict[str, Any]:
    import yaml

    if not Path(path).is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    with open(path) as handle:
        cfg = yaml.safe_load(handle) or {}
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise ValueError(f"--config {path}: not a vitlab training config (no 'model' section)")
    return cfg


def _num_classes(data: dict[str, Any]) -> int:
    return _data_module(data).num_classes


def _datamodule_args(data: dict[str, Any]) -> dict[str, Any]:
    keep = {"root", "in_chans", "window", "window_center", "window_width", "window_index", "frames", "val_fraction", "test_fraction",
            "seed", "on_bad_file", "mean", "std", "embedded_kwargs", "classes", "labels", "sample", "slab_radius", "slice_labels",
            "intensity", "min_mask_voxels", "spacing", "volume_size"}
    return {k: v for k, v in (data or {}).items() if k in keep}


def _data_module(data: dict[str, Any], **overrides: Any):
    """The data module of a training config's data section (a detection run's COCO JSON through the dense one)."""
    from vitlab.data.dense_data import DenseImageData
    from vitlab.data.image_data import ImageData

    args = {**_datamodule_args(data), **overrides}
    if (data or {}).get("coco_json"):  # its images are those of the JSON, not of `root`
        return DenseImageData(**args, coco_json=data["coco_json"], coco_mask_dir=data.get("coco_mask_dir"))
    return ImageData(**args)


# ---------------------------------------------------------------------------------------------- images


@dataclass
class ImageBatch:
    """Probe images: ``pixels`` in [0, 1] (for display / inversion targets) and the model input."""

    pixels: torch.Tensor  # (N, C, H, W) in [0, 1]; a 3-D model's volumes: (N, C, I, J, K)
    inputs: torch.Tensor  # (N, C, H, W) normalised with the model's mean/std (volumes: as training gave them)
    labels: torch.Tensor | None  # (N,) int64, when the source has labels
    names: list[str]
    class_names: list[str] | None = None
    spacing: tuple[float, float, float] | None = None  # volumes: mm per voxel along i, j, k (one for all)
    masks: torch.Tensor | None = None  # (N, I, J, K) int64 label maps on the volumes' grid, when the data has mask_classes
    mask_classes: list[str] | None = None  # names of the mask values 1..K


def load_images(args: argparse.Namespace, loaded: LoadedModel, default_count: int, split: str | None = None,
                volumes: bool = False) -> ImageBatch:
    """Images from --images, else the split of --config's data section, else of the embedded dataset
    (``volumes``: a 3-D model's volumes, else such a model is refused)."""
    stream = image_stream(args, loaded, default_count, split, volumes)
    items = [stream.read(i) for i in range(stream.count)]
    pixels = torch.stack([pixel for pixel, _, _ in items])
    labels = torch.tensor([label for _, label, _ in items]) if stream.labelled else None
    batch = _finish(pixels, labels, [name for _, _, name in items], stream.class_names, stream.mean, stream.std)
    batch.spacing = stream.spacing
    if stream.read_mask is not None:
        batch.masks, batch.mask_classes = torch.stack([stream.read_mask(i) for i in range(stream.count)]), stream.mask_classes
    return batch


@dataclass
class ImageStream:
    """The probe images of :func:`load_images`, read on demand: memory holds one batch, not all N images."""

    count: int
    read: Callable[[int], tuple[torch.Tensor, int | None, str]]  # i -> ((C, H, W) pixels in [0, 1], label, name)
    mean: list[float]
    std: list[float]
    labelled: bool
    class_names: list[str] | None = None
    spacing: tuple[float, float, float] | None = None  # volumes: mm per voxel along i, j, k, the same for every volume
    read_mask: Callable[[int], torch.Tensor] | None = None  # i -> (I, J, K) int64 label map of volume i (data with mask_classes)
    mask_classes: list[str] | None = None  # names of the mask values 1..K

    @property
    def volumetric(self) -> bool:
        return self.spacing is not None

    def pixel_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """(b, C, H, W) (volumes: (b, C, I, J, K)) pixels in [0, 1] and (b,) labels (None when unlabelled), in order."""
        for start in range(0, self.count, batch_size):
            items = [self.read(i) for i in range(start, min(start + batch_size, self.count))]
            labels = torch.tensor([label for _, label, _ in items]) if self.labelled else None
            yield torch.stack([pixel for pixel, _, _ in items]), labels

    def image_batches(self, batch_size: int) -> Iterator[ImageBatch]:
        """The stream as :class:`ImageBatch` chunks of ``batch_size`` (the last one shorter), in order, with their
        names, spacing and (when the stream has them) label maps: ``load_images`` a batch at a time."""
        for start in range(0, self.count, batch_size):
            index = range(start, min(start + batch_size, self.count))
            items = [self.read(i) for i in index]
            labels = torch.tensor([label for _, label, _ in items]) if self.labelled else None
            batch = _finish(torch.stack([pixel for pixel, _, _ in items]), labels, [name for _, _, name in items], self.class_names,
                            self.mean, self.std)
            batch.spacing = self.spacing
            if self.read_mask is not None:
                batch.masks, batch.mask_classes = torch.stack([self.read_mask(i) for i in index]), self.mask_classes
            yield batch

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """Normalised model inputs (b, C, H, W), the same values as ``load_images(...).inputs``, in order."""
        for pixels, _ in self.pixel_batches(batch_size):
            yield _finish(pixels, None, [], None, self.mean, self.std).inputs


VOLUME_PROBES = "drift, spectra, claims, attention, mi, stats, features and ablate"


def planar_input(model: nn.Module, source: str) -> tuple[int, int, int]:
    """The model's (in_chans, H, W); a 3-D model (a volume input) is refused in one line naming the probes
    that take one."""
    shape = tuple(models.input_size(model))
    if len(shape) != 3:
        raise ValueError(f"{source}: a 3-D model (input {shape}: channels and a {len(shape) - 1}-D volume); this probe reads 2-D "
                         f"images and draws 2-D maps and does not take 3-D checkpoints (the probes that do: {VOLUME_PROBES})")
    return shape  # type: ignore[return-value]


def image_stream(args: argparse.Namespace, loaded: LoadedModel, default_count: int, split: str | None = None,
                 volumes: bool = False) -> ImageStream:
    """The images :func:`load_images` would return, as a stream (the files are listed, not read); with
    ``volumes``, a 3-D model's volumes (:func:`volume_stream`)."""
    from vitlab.data import read_image
    from vitlab.data.image_data import ImageData

    count = args.num_images or default_count
    if count < 1:
        raise ValueError(f"--num-images must be >= 1, got {count}")
    split = split or args.split
    if volumes and len(models.input_size(loaded.model)) == 4:
        return volume_stream(args, loaded, count, split)
    in_chans, height, width = planar_input(loaded.model, loaded.source)
    mean, std = models.normalization(loaded.model)
    if args.images:
        files = _expand_images(args.images)[:count]
        return ImageStream(len(files), lambda i: (_to_tensor(read_image(files[i]), in_chans, height, width), None, str(files[i])), mean, std, False)
    dm = _data_module(loaded.data or {}, in_chans=in_chans, image_size=height, augment="none", num_workers=0, mean=[0.0] * in_chans, std=[1.0] * in_chans)
    samples = dm.samples(split)
    labelled = getattr(dm, "has_labels", True)
    if not samples and not labelled:  # unlabelled images (data.labels false) are all in train
        split, samples = "train", dm.samples("train")
    if not samples:
        raise ValueError(f"the data has no '{split}' images; choose --split among those present or pass --images")
    generator = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(samples), generator=generator)[:count].tolist()
    dataset = ImageData.dataset(dm, split)  # (image, label) items, also for dense data

    def read(i: int) -> tuple[torch.Tensor, int, str]:
        image, label = dataset[order[i]]
        return image.float().clamp(0, 1), int(label), str(samples[order[i]].path)

    return ImageStream(len(order), read, mean, std, labelled, dm.class_names if labelled else None)


def volume_stream(args: argparse.Namespace, loaded: LoadedModel, count: int, split: str) -> ImageStream:
    """A 3-D model's probe volumes, read one at a time as training reads them (:class:`~vitlab.data.datasets.volumes.VolumeDataset`):
    resampled to ``--spacing`` (else the config's ``data.spacing``, else left at each volume's own), cropped / padded
    about the centre to the model's input size, intensities through the config's window / ``data.intensity``, no
    mean / std (training gives volumes to the model in [0, 1]). Volumes come from ``--images`` (NIfTI files, DICOM
    series folders, folders holding them), else the split of the config's data.

    The stream's ``spacing`` is the voxel size in mm along i, j, k of every volume it gives: distances in the 3-D
    probes are millimetres (docs/volumes.md). Volumes of different voxel sizes (no spacing to resample to) are refused
    in one line when read.

    With data that has ``mask_classes`` (a segmentation run's) and a label map for every chosen volume, the stream's
    ``read_mask`` gives each volume's label map on the volume's grid (resampled with nearest neighbours, as training
    reads it; one load per volume serves ``read`` and ``read_mask``) and ``mask_classes`` names its values 1..K.
    """
    from vitlab.data.datasets.volumes import VolumeDataset
    from vitlab.data.layouts import UNLABELLED, Sample
    from vitlab.data.readers.options import ReadOptions
    from vitlab.data.volume_layouts import volume_problem, volumes_under
    from vitlab.data.volume_options import VolumeOptions

    in_chans, *size = models.input_size(loaded.model)
    data = dict(loaded.data or {})
    spacing = args.spacing or data.get("spacing")
    if spacing is not None and (len(spacing) != 3 or min(spacing) <= 0):
        raise ValueError(f"--spacing / data.spacing must be three voxel sizes > 0 in mm, got {list(spacing)}")
    if args.images:
        samples: list[Sample] = []
        for path in map(Path, args.images):
            problem = None if path.is_dir() else volume_problem(path)
            if problem is not None:
                raise ValueError(f"--images {path} {problem}")
            found = volumes_under(path) if path.is_dir() else [(path, None)]  # NIfTI files and series folders under it
            samples += [Sample(p.resolve(), UNLABELLED, series_uid=uid) for p, uid in found]
        if not samples:
            raise ValueError(f"--images {' '.join(args.images)}: no volumes (.nii / .nii.gz files or folders of DICOM files)")
        samples, labelled, class_names, mask_classes = samples[:count], False, None, None
        read_options = ReadOptions(**{k: data[k] for k in ("window", "window_center", "window_width", "window_index") if k in data})
        options = VolumeOptions("volume", intensity=data.get("intensity", "window"), spacing=spacing, volume_size=size)
    else:
        if data.get("sample") != "volume":
            data.update(sample="volume", volume_size=list(size))
        dm = _data_module(data, in_chans=in_chans, augment="none", num_workers=0, volume_size=list(size), spacing=spacing)
        samples = dm.samples(split)
        labelled = getattr(dm, "has_labels", True)
        if not samples and not labelled:
            split, samples = "train", dm.samples("train")
        if not samples:
            raise ValueError(f"the data has no '{split}' volumes; choose --split among those present or pass --images")
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(args.seed))[:count].tolist()
        samples = [samples[i] for i in order]
        class_names = dm.class_names if labelled else None
        options, read_options = dm.volume_options, dm.read_options
        # segmentation data: the label maps come with the volumes, on their grid (every chosen volume needs one)
        with_masks = bool(data.get("mask_classes")) and all(s.mask is not None for s in samples)
        mask_classes = [str(name) for name in data["mask_classes"]] if with_masks else None
    dataset = VolumeDataset(samples, class_names or [UNLABELLED], options, read_options, on_bad_file="error",
                            num_mask_classes=len(mask_classes) if mask_classes else None)
    masks: dict[int, torch.Tensor] = {}  # the label map of the volume read last: read and read_mask share one load
    first = None if spacing is not None else tuple(float(v) for v in dataset.load_volume(0)[0].spacing)

    def read(i: int) -> tuple[torch.Tensor, int | None, str]:
        volume, label = dataset[i]
        if mask_classes:
            masks.clear()
            masks[i], label = label["mask"], dataset.labels[i]
        if first is not None:
            own = tuple(float(v) for v in dataset.last_spacing)  # of the volume just read (not read again)
            if max(abs(a - b) / b for a, b in zip(own, first)) > 0.01:
                mm = lambda size: " x ".join(f"{v:.4g}" for v in size)  # noqa: E731
                raise ValueError(f"{samples[i].key}: voxel size {mm(own)} mm differs from {mm(first)} mm of {samples[0].key}; distances in "
                                 "mm need one voxel size: pass --spacing MM MM MM (or set data.spacing) to resample every volume to it")
        vol = volume.float().clamp(0, 1)
        if vol.shape[0] != in_chans:
            vol = vol[:1].repeat(in_chans, *[1] * (vol.ndim - 1))
        return vol, (int(label) if labelled else None), samples[i].key

    def read_mask(i: int) -> torch.Tensor:
        if i not in masks:
            read(i)
        return masks[i]

    return ImageStream(len(samples), read, [0.0] * in_chans, [1.0] * in_chans, labelled, class_names,
                       tuple(float(v) for v in (spacing or first)), read_mask if mask_classes else None, mask_classes)


def _finish(pixels, labels, names, class_names, mean, std) -> ImageBatch:
    shape = (1, -1) + (1,) * (pixels.ndim - 2)
    m = torch.tensor(mean).view(shape)
    s = torch.tensor(std).view(shape)
    return ImageBatch(pixels, (pixels - m) / s, labels, names, class_names)


def _to_tensor(array, in_chans: int, height: int, width: int) -> torch.Tensor:
    import torch.nn.functional as F

    t = torch.as_tensor(array, dtype=torch.float32)
    t = t.unsqueeze(0) if t.ndim == 2 else t.permute(2, 0, 1)  # (C, H, W)
    if t.shape[0] != in_chans:
        t = t.mean(0, keepdim=True).repeat(in_chans, 1, 1) if in_chans in (1, 3) else t[:1].repeat(in_chans, 1, 1)
    return F.interpolate(t[None], size=(height, width), mode="bilinear", align_corners=False, antialias=True)[0].clamp(0, 1)


def _expand_images(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
                            and "masks" not in f.relative_to(p).parts[:-1])  # label maps (vitlab.data.masks) are not images
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"--images {p}: no such file or folder")
    if not files:
        raise ValueError(f"--images {' '.join(paths)}: no image files ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


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
