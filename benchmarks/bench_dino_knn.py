"""Benchmark: does the quickstart DINO pretraining learn? Loss, collapse signals and the teacher's k-NN per epoch.

Builds the data and ``DINOModule`` of ``configs/dino_pretrain.yaml`` (any ``model.`` key can be overridden), scores
the teacher's k-NN at random init (DINO's: k = 20, cosine, exp(sim / 0.07) votes, train split -> labelled val
split), trains for ``--epochs`` with the config's trainer settings (gradient clipping included) and prints per
epoch: ``train/loss``, the per-sample and batch-mean teacher entropies (collapse signals, log K = uniform), the
centre's norm and ``val/knn_acc``. Asserts that the loss fell and that the teacher collapsed neither to uniform
(per-sample entropy > 0.9 log K) nor to one prototype (batch-mean entropy < 0.25 log K); prints the k-NN gain
(it does not assert one: see docs/dino.md for what this dataset gives).
Run: ``python benchmarks/bench_dino_knn.py [--epochs 15] [--threads 2] [--set center_momentum=0.9 ...]``
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from vitlab.runtime import prepare_process

prepare_process()  # (first: its OpenMP spin policy must precede torch's thread pool)
import pytorch_lightning as pl
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from vitlab import models
from vitlab.analysis import weighted_knn
from vitlab.data.datamodule import MedicalDataModule
from vitlab.training.dino import DINOModule

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dino_pretrain.yaml"
TAGS = ("train/loss_epoch", "dino/teacher_entropy", "dino/teacher_entropy_mean", "dino/center_norm", "val/knn_acc")


def override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set takes key=value (a model. key of {CONFIG.name}), got {text!r}")
    return key, yaml.safe_load(value)


@torch.no_grad()
def teacher_knn(module: DINOModule, dm: MedicalDataModule) -> float:
    def features(split):
        loader = torch.utils.data.DataLoader(dm.dataset(split), batch_size=64)
        pairs = [(models.pooled_features(module.teacher_model.eval(), x), y) for x, y in loader]
        return torch.cat([f for f, _ in pairs]), torch.cat([y for _, y in pairs])

    return weighted_knn(*features("train"), *features("val"), k=module.hparams.knn_k, temperature=module.hparams.knn_temperature).accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="default: the config's trainer.max_epochs")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", type=override, action="append", default=[], metavar="KEY=VALUE", help="a model. hyper-parameter")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = yaml.safe_load(CONFIG.read_text())
    model_cfg = {**cfg["model"], **dict(args.set)}
    epochs = args.epochs or cfg["trainer"]["max_epochs"]
    pl.seed_everything(cfg.get("seed_everything", 0), workers=True)
    dm = MedicalDataModule(**cfg["data"])
    dm.setup()
    module = DINOModule(**model_cfg, num_classes=dm.num_classes, class_names=dm.class_names)
    knn_init = teacher_knn(module, dm)
    with tempfile.TemporaryDirectory() as tmp:
        logger = pl.loggers.TensorBoardLogger(tmp, name="dino", default_hp_metric=False)
        trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=logger, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             gradient_clip_val=cfg["trainer"].get("gradient_clip_val"), log_every_n_steps=5)
        start, cpu = time.perf_counter(), time.process_time()
        trainer.fit(module, dm)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
        acc.Reload()
        rows = {tag: [e.value for e in acc.Scalars(tag)] for tag in TAGS}
    log_k = math.log(model_cfg["out_dim"])
    changed = dict(args.set)
    print(f"{CONFIG.name} {changed or ''}: {epochs} epochs, {len(dm.samples('train'))} train / {len(dm.samples('val'))} val images, "
          f"wall {wall:.0f} s, CPU {cpu:.0f} s, threads {torch.get_num_threads()}; log K = {log_k:.2f}")
    print("epoch   loss  entropy  entropy(mean)  centre  k-NN")
    print(f" init      -        -              -       -  {knn_init:.3f}")
    for i in range(epochs):
        print(f"{i:6d} {rows[TAGS[0]][i]:6.3f}  {rows[TAGS[1]][i]:7.2f}  {rows[TAGS[2]][i]:13.2f}  {rows[TAGS[3]][i]:6.2f}  {rows[TAGS[4]][i]:.3f}")
    loss, per_sample, batch_mean, knn = rows[TAGS[0]], rows[TAGS[1]], rows[TAGS[2]], rows[TAGS[4]]
    print(f"k-NN: random init {knn_init:.3f} -> last {knn[-1]:.3f} (best {max(knn):.3f}); chance {1 / dm.num_classes:.3f}")
    assert min(loss) < loss[0] - 0.2, f"the loss did not fall: {loss}"
    assert per_sample[-1] < 0.9 * log_k, f"uniform collapse: per-sample teacher entropy {per_sample[-1]:.2f} of log K = {log_k:.2f}"
    assert batch_mean[-1] > 0.25 * log_k, f"one-hot collapse: batch-mean teacher entropy {batch_mean[-1]:.2f} of log K = {log_k:.2f}"


if __name__ == "__main__":
    main()
