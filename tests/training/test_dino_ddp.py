"""DINO under a 2-process CPU DDP fit (gloo, ddp_spawn): rank-0 writes, an all-reduced centre, k-NN on the
gathered features of both splits, teacher and centre in the checkpoint, and a DDP resume that appends to the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from pytorch_lightning.callbacks import Callback

pytest.importorskip("lightly")

from tests.helpers.runs import DDP_SPAWN, DINO_TINY, events  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
GATHER_ROWS = 7  # an odd count: the DistributedSampler pads rank 1 with a repeat of row 0


class RankProbe(Callback):
    """Test-only: what each rank sees, gathered on all ranks (collectives on every rank), written to ``rank<r>.json``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict = {"centre_gap": [], "teacher_gap": []}

    def _spread(self, trainer, tensor: torch.Tensor) -> float:
        gathered = trainer.strategy.all_gather(tensor.detach().flatten())  # (W, N)
        return float((gathered - gathered[0]).abs().max())

    def on_train_start(self, trainer, module) -> None:
        self.record["centre_at_start"] = module.criterion.center.flatten().tolist()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        # each rank updated its centre after the DDP forward (which broadcasts rank 0's buffers): equal only if reduced
        self.record["centre_gap"].append(self._spread(trainer, module.criterion.center))
        self.record["teacher_gap"].append(self._spread(trainer, torch.cat([p.flatten() for p in module.teacher_model.parameters()])))

    def on_validation_epoch_end(self, trainer, module) -> None:
        sampler = torch.utils.data.DistributedSampler(range(GATHER_ROWS), num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
        rows = torch.tensor(list(sampler), dtype=torch.float32)[:, None] * torch.ones(1, 3)  # (rows of this rank, 3)
        self.record["gathered"] = module._gather_shards(rows, GATHER_ROWS)[:, 0].tolist()
        self.record["val_sampler"] = type(trainer.val_dataloaders.sampler).__name__  # what DINO gathers from

    def on_train_end(self, trainer, module) -> None:
        self.record.update(rank=trainer.global_rank, world=trainer.world_size, centre_at_end=module.criterion.center.flatten().tolist())
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def ddp_config(manifest: Path, save_dir: Path, probe: Path, epochs: int) -> list[str]:
    probe.mkdir(parents=True, exist_ok=True)
    cfg = {
        "seed_everything": 0,
        "task": "dino",
        "trainer": {
            "max_epochs": epochs, "accelerator": "cpu", "devices": 2, "strategy": DDP_SPAWN, "log_every_n_steps": 1,
            "num_sanity_val_steps": 0, "enable_progress_bar": False, "enable_model_summary": False,
            "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger", "init_args": {"save_dir": str(save_dir), "name": "dino", "default_hp_metric": False}},
            "callbacks": [{"class_path": "vitlab.callbacks.QKVSnapshot"}, {"class_path": "vitlab.callbacks.QKVDrift"},
                          {"class_path": "vitlab.callbacks.QKSpectra"}, {"class_path": "tests.training.test_dino_ddp.RankProbe", "init_args": {"out": str(probe)}}],
        },
        "model": {**DINO_TINY, "lr": 1e-3, "warmup_epochs": 0.5, "warmup_teacher_temp_epochs": 2},
        # 8 patients x 3 slices, one patient in validation: 21 train / 3 val images, both odd (sampler padding)
        "runtime": {"workers": 0}, "data": {"root": str(manifest), "image_size": 32, "batch_size": 4, "augment": "none", "val_fraction": 0.125},
    }
    path = save_dir / f"dino_ddp_{epochs}.yaml"
    save_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


def probes(folder: Path) -> list[dict]:
    found = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    assert [r["rank"] for r in found] == [0, 1] and all(r["world"] == 2 for r in found)
    return found


@pytest.mark.slow
def test_dino_ddp_writes_once_reduces_the_centre_scores_knn_and_resumes(tmp_path_factory, tmp_path):
    from vitlab.analysis import weighted_knn
    from vitlab.cli import fit
    from vitlab.data.synthetic import generate
    from vitlab import models

    manifest = generate(tmp_path_factory.mktemp("dino-ddp-data"), seed=0, patients=8, slices=3, size=32)
    runs = tmp_path / "runs"
    cli = fit(ddp_config(manifest, runs, tmp_path / "probe1", epochs=1))
    run = runs / "dino" / "version_0"

    # rank 0 alone wrote: one run folder, one event file, one set of snapshots and tables
    assert [p.name for p in (runs / "dino").iterdir()] == ["version_0"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 1
    qkv = sorted(p.name for p in (run / "qkv").iterdir() if not p.name.startswith("."))
    assert qkv == ["drift_epoch_001.csv", "epoch_000.safetensors", "epoch_001.safetensors", "spectra_epoch_000.csv", "spectra_epoch_001.csv"], qkv

    # the centre is all-reduced: equal on both ranks after every step (and not still zero); the teacher too
    first = probes(tmp_path / "probe1")
    steps = len(first[0]["centre_gap"])
    assert steps == 3 and all(len(r["centre_gap"]) == steps for r in first)  # 21 images / 2 ranks / 4 per batch
    assert max(first[0]["centre_gap"]) == 0.0 and max(first[0]["teacher_gap"]) == 0.0
    assert first[0]["centre_at_end"] == first[1]["centre_at_end"] and any(v != 0 for v in first[0]["centre_at_end"])
    # the sampler's shards gathered back in dataset order, its padding dropped, on both ranks
    assert all(r["gathered"] == [float(i) for i in range(GATHER_ROWS)] for r in first)
    assert all(r["val_sampler"] == "DistributedSampler" for r in first)

    # teacher and centre in the checkpoint (the centre rank 0 ended with)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["state_dict"]
    assert any(k.startswith("teacher_model.") for k in state) and any(k.startswith("teacher_head.") for k in state)
    assert state["criterion.center"].flatten().tolist() == first[0]["centre_at_end"]

    # k-NN under DDP scored every image once: the logged value equals a one-process recomputation from the checkpoint
    module, dm = cli.model, cli.datamodule
    module.load_state_dict(state)
    module.eval()
    dm.setup("fit")
    with torch.no_grad():
        banks = []
        for split in ("train", "val"):
            data = [dm.dataset(split)[i] for i in range(len(dm.dataset(split)))]
            banks.append((models.pooled_features(module.teacher_model, torch.stack([x for x, _ in data])), torch.tensor([int(y) for _, y in data])))
    assert (len(banks[0][1]), len(banks[1][1])) == (21, 3)
    score = weighted_knn(*banks[0], *banks[1], k=module.hparams.knn_k, temperature=module.hparams.knn_temperature)
    acc = events(run)
    logged = acc.Scalars("val/knn_acc")
    assert len(logged) == 1 and logged[0].value == pytest.approx(score.accuracy, abs=1e-6)
    assert acc.Scalars("hp/best_val_knn_acc")[-1].value == pytest.approx(score.accuracy, abs=1e-6)  # the base's hparams table

    # resume under DDP: the same run folder, the centre restored on both ranks, one more point per tag
    fit([*ddp_config(manifest, runs, tmp_path / "probe2", epochs=2), "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert [p.name for p in (runs / "dino").iterdir()] == ["version_0"]
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # one per fit, from rank 0
    assert (run / "qkv" / "epoch_002.safetensors").is_file() and (run / "qkv" / "drift_epoch_002.csv").is_file()
    second = probes(tmp_path / "probe2")
    assert all(r["centre_at_start"] == first[0]["centre_at_end"] for r in second)
    assert max(second[0]["centre_gap"]) == 0.0 and second[0]["centre_at_end"] == second[1]["centre_at_end"]
    acc = events(run)
    assert [e.step for e in acc.Scalars("val/knn_acc")] == [steps - 1, 2 * steps - 1]
    for kind, read in (("scalars", acc.Scalars), ("histograms", acc.Histograms), ("images", acc.Images)):
        for tag in acc.Tags()[kind]:  # two processes, two fits: still one point per step
            tag_steps = [e.step for e in read(tag)]
            assert tag == "epoch" or len(tag_steps) == len(set(tag_steps)), (tag, tag_steps)
    assert len(acc.Scalars("dino/center_norm")) == 2 and len(acc.Scalars("train/loss_step")) == 2 * steps
