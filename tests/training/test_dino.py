"""DINO (docs/dino.md): loss against its definition, centring, temperatures, stop-gradient, EMA, multi-crop, k-NN, e2e."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytest.importorskip("lightly")

from tests.helpers.runs import DINO_TINY, tiny_args  # noqa: E402
from vitlab import models  # noqa: E402
from vitlab.analysis import weighted_knn  # noqa: E402
from vitlab.data.multicrop import MultiCrop  # noqa: E402
from vitlab.training.dino import DINOModule, entropy, teacher_temperature  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def definition_loss(teacher, student, center, t_temp, s_temp):
    """DINO's loss written out: mean over pairs (global x, any x' != x) of -sum_k P_t(x)_k log P_s(x')_k, batch mean."""
    terms = []
    for i, t in enumerate(teacher):
        p_t = torch.softmax((t - center) / t_temp, dim=-1)
        for j, s in enumerate(student):
            if i == j:
                continue
            terms.append(-(p_t * torch.log_softmax(s / s_temp, dim=-1)).sum(-1).mean())
    return torch.stack(terms).mean()


def test_loss_matches_definition_and_updates_centre():
    torch.manual_seed(0)
    module = DINOModule(**DINO_TINY, student_temp=0.1, center_momentum=0.8)
    crit = module.criterion
    center = torch.randn(1, 1, 64)
    crit.center.copy_(center)
    teacher = [torch.randn(5, 64) for _ in range(2)]
    student = [torch.randn(5, 64) for _ in range(4)]
    loss = crit(teacher, student, teacher_temp=0.05)
    expected = definition_loss(teacher, student, center[0, 0], 0.05, 0.1)
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    with_diagonal = torch.stack([-(torch.softmax((t - center[0, 0]) / 0.05, -1) * torch.log_softmax(s / 0.1, -1)).sum(-1).mean()
                                 for t in teacher for s in student]).mean()
    assert abs(float(with_diagonal) - float(expected)) > 1e-3  # the identical-view pairs would change it
    batch_mean = torch.stack(teacher).mean(dim=(0, 1))
    assert torch.allclose(crit.center[0, 0], 0.8 * center[0, 0] + 0.2 * batch_mean, atol=1e-6)


def test_teacher_temperature_warmup_and_entropy():
    assert [teacher_temperature(e, 0.04, 0.07, 3) for e in range(5)] == pytest.approx([0.04, 0.05, 0.06, 0.07, 0.07])
    assert float(entropy(torch.full((8,), 1 / 8))) == pytest.approx(math.log(8))
    assert float(entropy(torch.eye(4)[0])) == pytest.approx(0.0)


class _Trainer:
    estimated_stepping_batches = 100
    global_step = 0


def test_stop_gradient_and_ema_update():
    torch.manual_seed(1)
    module = DINOModule(**DINO_TINY, momentum_start=0.9, momentum_end=1.0, freeze_last_layer=0)
    module._trainer = _Trainer()  # momentum() reads the run length
    with torch.no_grad():  # teacher differs from student, so the EMA is visible
        for p in module.teacher_model.parameters():
            p.add_(torch.randn_like(p))
    images = torch.randn(4, 1, 32, 32)
    teacher_out, student_out = module.dino_outputs(module.multicrop(images))
    assert not any(t.requires_grad for t in teacher_out) and all(s.requires_grad for s in student_out)
    loss = module.criterion(teacher_out, student_out, teacher_temp=0.04)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in [*module.teacher_model.parameters(), *module.teacher_head.parameters()])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.model.parameters())
    student = [p.detach().clone() for p in module.model.parameters()]
    teacher = [p.detach().clone() for p in module.teacher_model.parameters()]
    m = module.momentum()
    assert m == pytest.approx(0.9)  # cosine schedule at step 0
    from lightly.models.utils import update_momentum

    update_momentum(module.model, module.teacher_model, m)
    for t0, s0, t1 in zip(teacher, student, module.teacher_model.parameters()):
        assert torch.allclose(t1, m * t0 + (1 - m) * s0, atol=1e-6)


def test_views_of_one_size_share_a_backbone_pass_with_per_view_results():
    torch.manual_seed(3)
    module = DINOModule(**{**DINO_TINY, "local_crops": 3})
    for p in [*module.parameters()]:  # randomised, teacher apart from the student
        p.data.normal_(0, 0.3)
    module.model.eval(), module.teacher_model.eval()  # no stochastic depth: the two orders give the same numbers
    views = module.multicrop(torch.randn(5, 1, 32, 32))
    teacher, student = module.dino_outputs(views)
    with torch.no_grad():
        alone = [module.teacher_head(models.pooled_features(module.teacher_model, v)) for v in views[:2]]
        alone += [module.head(models.pooled_features(module.model, v)) for v in views]
    assert [tuple(x.shape) for x in teacher + student] == [tuple(x.shape) for x in alone]
    for got, want in zip(teacher + student, alone):
        assert torch.allclose(got, want, atol=1e-5)


def test_multicrop_view_sizes_and_boxes():
    crop = MultiCrop(global_size=32, local_size=12, local_crops=3, global_scale=(0.4, 1.0), local_scale=(0.1, 0.3))
    images = torch.randn(6, 1, 40, 48)
    views = crop(images, generator=torch.Generator().manual_seed(0))
    assert [tuple(v.shape) for v in views] == [(6, 1, 32, 32)] * 2 + [(6, 1, 12, 12)] * 3
    boxes = crop.boxes(1000, 40, 48, (0.1, 0.3), generator=torch.Generator().manual_seed(1))
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) / (40 * 48)
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 2] <= 48 + 1e-4).all() and (boxes[:, 3] <= 40 + 1e-4).all()
    assert area.min() >= 0.1 - 1e-4 and area.max() <= 0.3 + 1e-4
    plain = MultiCrop(global_size=40, local_crops=0, global_scale=(1.0, 1.0), contrast=0.0, noise=0.0, blur_sigma=(0.1, 0.1), flip=False, ratio=(1.0, 1.0))
    ramp = torch.arange(40.0).repeat(40, 1)[None, None]  # a full-image crop at the same size is the identity
    same = plain.view(ramp, 40, (1.0, 1.0), 0.0)  # (bilinear samples clamp at the outermost pixels)
    assert torch.allclose(same[..., 1:-1], ramp[..., 1:-1], atol=1e-4)
    fine = torch.rand(3, 1, 60, 60, generator=torch.Generator().manual_seed(2))  # shrinking 3x averages 3 x 3 pixels
    assert torch.allclose(plain.view(fine, 20, (1.0, 1.0), 0.0), F.avg_pool2d(fine, 3), atol=1e-5)  # (no aliasing)
    with pytest.raises(ValueError, match="global_scale"):
        MultiCrop(global_scale=(0.0, 1.0))


def test_multicrop_intensity_changes_per_sample():
    """Flip, blur, contrast / brightness and noise act on each sample as documented, and only on the samples drawn."""
    from torchvision.transforms.v2.functional import gaussian_blur

    g = torch.Generator().manual_seed(4)
    images = torch.rand(24, 1, 20, 20, generator=g)
    whole = dict(global_size=20, local_crops=0, global_scale=(1.0, 1.0), ratio=(1.0, 1.0), contrast=0.0, noise=0.0, flip=False)
    # a full-image crop at the same size samples every pixel centre: the identity (bilinear weights of 0 / 1)
    assert torch.allclose(MultiCrop(**whole).view(images, 20, (1.0, 1.0), 0.0), images, atol=1e-5)

    flipped = MultiCrop(**{**whole, "flip": True, "contrast": 0.25}).view(images, 20, (1.0, 1.0), 0.0, generator=g)
    kinds = []
    for x, y in zip(images, flipped):  # y = gain * (x' - mean) + mean + shift, x' = x or its mirror image
        fits = []
        for candidate in (x, x.flip(-1)):
            design = torch.stack([candidate.flatten(), torch.ones(candidate.numel())], dim=1).double()
            coef = torch.linalg.lstsq(design, y.flatten().double()[:, None]).solution.flatten()
            fits.append(((design @ coef - y.flatten().double()).abs().max().item(), coef))
        kind = min((0, 1), key=lambda i: fits[i][0])
        residual, (gain, offset) = fits[kind]
        assert residual < 1e-5
        assert 0.75 - 1e-6 <= gain <= 1.25 + 1e-6
        shift = offset - (1 - gain) * x.mean().double()
        assert abs(shift) <= 0.25 + 1e-5
        kinds.append(kind)
    assert 0 < sum(kinds) < len(kinds)  # some samples flipped, some not

    sigma = 1.2
    kernel = 2 * math.ceil(2 * sigma) + 1
    blurred = gaussian_blur(images, [kernel, kernel], [sigma, sigma])
    some = MultiCrop(**{**whole, "blur_sigma": (sigma, sigma)}).view(images, 20, (1.0, 1.0), 0.5, generator=g)
    hit = [torch.allclose(y, b, atol=1e-5) for y, b in zip(some, blurred)]
    miss = [torch.allclose(y, x, atol=1e-5) for y, x in zip(some, images)]
    assert all(h != m for h, m in zip(hit, miss)) and 0 < sum(hit) < len(hit)  # each sample blurred or untouched

    noisy = MultiCrop(**{**whole, "noise": 0.1}).view(images, 20, (1.0, 1.0), 0.0, generator=g)
    std = (noisy - images).flatten(1).std(dim=1)
    assert (std > 0).all() and (std < 0.1 * 1.3).all() and std.max() > 0.05  # per-sample std drawn from [0, noise]


def test_weighted_knn_against_loop():
    g = torch.Generator().manual_seed(2)
    train_x, test_x = torch.randn(30, 5, generator=g), torch.randn(7, 5, generator=g)
    train_y, test_y = torch.randint(0, 3, (30,), generator=g), torch.randint(0, 3, (7,), generator=g)
    score = weighted_knn(train_x, train_y, test_x, test_y, k=5, temperature=0.07)
    for i in range(7):
        sims = torch.nn.functional.cosine_similarity(test_x[i][None].double(), train_x.double())
        top = sims.argsort(descending=True)[:5]
        votes = torch.zeros(3, dtype=torch.float64)
        for j in top:
            votes[train_y[j]] += math.exp(float(sims[j]) / 0.07)
        assert int(score.predictions[i]) == int(votes.argmax())
    centres = torch.eye(2) * 5
    x = torch.cat([centres[0] + 0.3 * torch.randn(20, 2, generator=g), centres[1] + 0.3 * torch.randn(20, 2, generator=g)])
    y = torch.arange(2).repeat_interleave(20)
    assert weighted_knn(x[::2], y[::2], x[1::2], y[1::2]).accuracy == 1.0


def dino_config(manifest, save_dir, epochs=2):
    cfg = {
        "seed_everything": 0,
        "trainer": {"max_epochs": epochs, "accelerator": "cpu", "devices": 1, "log_every_n_steps": 1, "enable_progress_bar": False,
                    "enable_model_summary": False,
                    "logger": {"class_path": "pytorch_lightning.loggers.TensorBoardLogger",
                               "init_args": {"save_dir": str(save_dir), "name": "dino", "default_hp_metric": False}},
                    "callbacks": [{"class_path": "vitlab.callbacks.QKVSnapshot"}, {"class_path": "vitlab.callbacks.QKVDrift"},
                                  {"class_path": "vitlab.callbacks.QKSpectra"}]},
        "checkpoint": {"monitor": "val/knn_acc"},
        "task": "dino",
        "model": {**DINO_TINY, "lr": 1e-3, "warmup_epochs": 0.5, "warmup_teacher_temp_epochs": 2},
        "runtime": {"workers": 0}, "data": {"root": str(manifest), "image_size": 32, "batch_size": 8, "augment": "none", "val_fraction": 0.25},
    }
    path = save_dir / "dino.yaml"
    save_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_tiny_pretraining_logs_checkpoints_and_resumes(tiny_dataset, tmp_path):
    from vitlab.qkv.state import load_snapshot
    from vitlab.cli import fit

    cfg = dino_config(tiny_dataset, tmp_path / "runs", epochs=1)
    cli = fit(["--config", str(cfg)])
    run = tmp_path / "runs" / "dino" / "version_0"
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss_epoch", "dino/teacher_entropy", "dino/teacher_entropy_mean", "dino/center_norm", "val/knn_acc"):
        assert tag in tags, tag
    assert 0.0 <= acc.Scalars("val/knn_acc")[0].value <= 1.0
    assert any(t.startswith("drift/") for t in tags) and any(t.startswith("spectra/") for t in tags)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = ckpt["state_dict"]
    assert any(k.startswith("teacher_model.") for k in state) and "criterion.center" in state
    assert not any(k.startswith("model.head.") and k.endswith("weight") and state[k].ndim == 2 and state[k].shape[0] == 2 for k in state)
    snap, meta = load_snapshot(run / "qkv" / "epoch_001.safetensors")  # the callbacks saw the student backbone
    from vitlab.qkv.state import qkv_state

    live = qkv_state(cli.model.model)
    assert all(torch.equal(snap[k], live[k]) for k in live)
    # resume: same run folder, teacher and centre restored, the epoch count continues
    cfg2 = dino_config(tiny_dataset, tmp_path / "runs", epochs=2)
    cli2 = fit(["--config", str(cfg2), "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    assert not (tmp_path / "runs" / "dino" / "version_1").exists()
    assert (run / "qkv" / "epoch_002.safetensors").is_file()
    assert cli2.trainer.current_epoch == 2
    acc.Reload()
    assert [e.step for e in acc.Scalars("val/knn_acc")][-1] > [e.step for e in acc.Scalars("val/knn_acc")][0]


@pytest.mark.slow
def test_finetune_from_dino_checkpoint_starts_at_the_pretrained_backbone(tiny_dataset, tmp_path, capsys):
    from vitlab.qkv.state import load_snapshot
    from vitlab.cli import fit, train_main

    fit(["--config", str(dino_config(tiny_dataset, tmp_path / "runs", epochs=1))])
    dino_run = tmp_path / "runs" / "dino" / "version_0"
    ckpt = dino_run / "checkpoints" / "last.ckpt"
    vit = {"model_name": DINO_TINY["model_name"], "model_kwargs": DINO_TINY["model_kwargs"], "weights": str(ckpt)}
    args = tiny_args(tiny_dataset, tmp_path / "ft", epochs=1)
    cfg = yaml.safe_load(open(args[1]))
    cfg["model"].update(vit)
    open(args[1], "w").write(yaml.safe_dump(cfg))
    fit(args)
    pretrained, _ = load_snapshot(dino_run / "qkv" / "epoch_001.safetensors")
    start, _ = load_snapshot(tmp_path / "ft" / "tiny" / "version_0" / "qkv" / "epoch_000.safetensors")
    assert start.keys() == pretrained.keys() and all(torch.equal(start[k], pretrained[k]) for k in start)
    # a pretraining checkpoint of another architecture: the mismatched keys are named
    cfg["model"].update({"model_kwargs": {**DINO_TINY["model_kwargs"], "embed_dim": 48}})
    open(args[1], "w").write(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit):
        train_main(args)
    err = capsys.readouterr().err
    assert str(ckpt)[:40] in err and "file (1, 17, 32) vs model (1, 17, 48)" in err


def test_knn_monitor_mismatch_is_refused(tiny_dataset, tmp_path, capsys):
    from vitlab.cli import train_main

    cfg = dino_config(tiny_dataset, tmp_path / "runs", epochs=1)
    with pytest.raises(SystemExit):
        train_main(["--config", str(cfg), "--model.knn_every_n_epochs", "2"])
    assert "knn_every_n_epochs = 2" in capsys.readouterr().err


def unlabelled_folder(tiny_dataset, root):
    """The tiny dataset's scans as a user's unlabelled archive: nested patient / series folders, one file flat at
    the top, a text file, a hidden file and a ``masks/`` folder that are not images to train on."""
    import shutil

    src = tiny_dataset.parent
    files = sorted(src.glob("P*/*.dcm"))
    for i, f in enumerate(files):
        dest = root / (f"{f.parent.name}/series_1/{f.name}" if i else f.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    (root / "README.txt").write_text("notes")
    (root / ".hidden.dcm").write_bytes(b"x")
    (root / "masks").mkdir()
    Image.fromarray(np.zeros((32, 32), np.uint8)).save(root / "masks" / "m.png")
    return files


def test_unlabelled_scans_layout_and_batches(tiny_dataset, tmp_path):
    from vitlab.data.datamodule import MedicalDataModule
    from vitlab.data.layouts import UNLABELLED, scan

    root = tmp_path / "archive"
    files = unlabelled_folder(tiny_dataset, root)
    layout = scan(root, labels=False)
    assert len(layout.samples) == len(files) and layout.class_names == [] and {s.label for s in layout.samples} == {UNLABELLED}
    assert not any("masks" in s.path.parts or s.path.name.startswith(".") for s in layout.samples)
    with pytest.raises(ValueError, match="need at least two.*data.labels false"):  # the labelled reading says what to do
        scan(root / "P0000")
    dm = MedicalDataModule(root=str(root), labels=False, image_size=32, batch_size=8, num_workers=0, augment="none", val_fraction=0.25)
    assert dm.num_classes == 0 and not dm.has_labels
    assert len(dm.samples("train")) == len(files) and dm.samples("val") == [] and dm.val_dataloader() == []
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (8, 1, 32, 32) and (labels == -1).all()
    # a manifest without a label column; its split column keeps test patients out of pretraining
    rows = ["path,split"] + [f"{f.relative_to(tiny_dataset.parent)},{'test' if f.parent.name == 'P0000' else 'train'}" for f in files]
    (tiny_dataset.parent / "unlabelled.csv").write_text("\n".join(rows) + "\n")
    dm = MedicalDataModule(root=str(tiny_dataset.parent / "unlabelled.csv"), labels=False, image_size=32, num_workers=0)
    assert len(dm.samples("train")) == len(files) - 4 and all(s.patient_id for s in dm.samples("train"))
    # its val rows are left out too: unlabelled images are never validated (DINO would score k-NN on label -1)
    rows = ["path,split"] + [f"{f.relative_to(tiny_dataset.parent)},{'val' if f.parent.name == 'P0001' else 'train'}" for f in files]
    (tiny_dataset.parent / "unlabelled_val.csv").write_text("\n".join(rows) + "\n")
    dm = MedicalDataModule(root=str(tiny_dataset.parent / "unlabelled_val.csv"), labels=False, image_size=32, num_workers=0)
    assert len(dm.samples("train")) == len(files) - 4 and dm.samples("val") == [] and dm.val_dataloader() == []
    with pytest.raises(ValueError, match="lacks column"):  # labelled reading of the same manifest
        MedicalDataModule(root=str(tiny_dataset.parent / "unlabelled.csv"), image_size=32, num_workers=0)
    # skip mode: a broken file among the scans is dropped, not fatal
    (root / "P0001" / "series_1" / "broken.dcm").write_bytes(b"DICM" * 10)
    with pytest.warns(UserWarning, match="broken.dcm"):
        dm = MedicalDataModule(root=str(root), labels=False, image_size=32, num_workers=0)
        assert len(dm.samples("train")) == len(files) and dm.skipped_files == 1
    with pytest.raises(ValueError, match="data.classes"):
        MedicalDataModule(root=str(root), labels=False, classes=["a", "b"])


@pytest.mark.slow
def test_dino_on_unlabelled_scans_trains_without_validation(tiny_dataset, tmp_path, capsys):
    from vitlab.cli import fit, train_main

    root = tmp_path / "archive"
    unlabelled_folder(tiny_dataset, root)
    cfg = dino_config(root, tmp_path / "runs", epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(["--config", str(cfg), "--data.labels", "false"])
    assert not [w for w in caught if "length of" in str(w.message) or "monitored key" in str(w.message)]
    assert "no best checkpoint by val/knn_acc" in capsys.readouterr().err
    run = tmp_path / "runs" / "dino" / "version_0"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss_epoch" in tags and "dino/teacher_entropy" in tags and not any(t.startswith("val/") for t in tags)
    # the probes read the run's unlabelled images (all in train); the one that needs labels says so
    from vitlab.probe_cli import probe_main

    ckpt = str(run / "checkpoints" / "last.ckpt")
    probe_main(["attention", "--checkpoint", ckpt, "--num-images", "2", "--out", str(tmp_path / "att")])
    assert list((tmp_path / "att").glob("events.out.tfevents.*"))
    with pytest.raises(SystemExit):
        probe_main(["features", "--checkpoint", ckpt, "--out", str(tmp_path / "feat")])
    assert "carry no labels" in capsys.readouterr().err
    # classification needs labels: one line that says what unlabelled images are for

    args = tiny_args(tiny_dataset, tmp_path / "cls", epochs=1)
    with pytest.raises(SystemExit):
        train_main([*args, "--data.root", str(root), "--data.labels", "false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert "task: dino" in err[-1] and "num_classes" in err[-1]


@pytest.mark.slow
def test_unlabelled_root_pretrains_beside_a_labelled_knn_set(tiny_dataset, tmp_path, capsys):
    """data.unlabelled_root: many unlabelled scans train DINO while the labelled root scores the k-NN."""
    from vitlab.cli import fit, train_main
    from vitlab.data.datamodule import MedicalDataModule

    extra = tmp_path / "archive"
    files = unlabelled_folder(tiny_dataset, extra)  # the same patients as the labelled set: the overlap is warned
    kwargs = dict(image_size=32, batch_size=8, num_workers=0, augment="none", val_fraction=0.25)
    labelled = MedicalDataModule(root=str(tiny_dataset), **kwargs)
    with pytest.warns(UserWarning, match="labelled \\['val'\\] patients.*optimistic"):
        dm = MedicalDataModule(root=str(tiny_dataset), unlabelled_root=str(extra), **kwargs)
        dm.setup()
    assert dm.num_classes == 2 and dm.unlabelled_root == extra and dm.samples("val") == labelled.samples("val")
    assert len(dm.samples("train")) == len(labelled.samples("train")) + len(files)
    assert len(dm.dataset("train", labelled_only=True)) == len(labelled.samples("train"))
    labels = torch.cat([y for _, y in dm.train_dataloader()])
    assert (labels == -1).sum() == len(files) and (labels >= 0).sum() == len(labelled.samples("train"))
    listed = tmp_path / "extra.csv"  # an unlabelled manifest's val / test rows stay out of training
    listed.write_text("path,split\n" + "".join(f"{f},{'test' if i % 2 else 'train'}\n" for i, f in enumerate(files)))
    with pytest.warns(UserWarning, match="optimistic"):
        dm = MedicalDataModule(root=str(tiny_dataset), unlabelled_root=str(listed), **kwargs)
        assert len(dm.samples("train")) == len(labelled.samples("train")) + len(files[::2])
    # a DINO run: k-NN every epoch on the labelled splits only (the bank leaves the unlabelled images out)
    cfg = dino_config(tiny_dataset, tmp_path / "runs", epochs=1)
    cli = fit(["--config", str(cfg), "--data.unlabelled_root", str(extra)])
    bank_x, bank_y = cli.model.train_bank()
    assert len(bank_x) == len(labelled.samples("train")) and (bank_y >= 0).all()
    acc = EventAccumulator(str(tmp_path / "runs" / "dino" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert len(acc.Scalars("val/knn_acc")) == 1
    assert (tmp_path / "runs" / "dino" / "version_0" / "checkpoints" / "best-epoch000.ckpt").is_file()
    # other tasks refuse the unlabelled images in one line, before writing a run folder

    args = tiny_args(tiny_dataset, tmp_path / "cls", epochs=1)
    with pytest.raises(SystemExit):
        train_main([*args, "--data.unlabelled_root", str(extra)])
    assert "task classification cannot learn from them" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "cls" / "tiny").exists()  # (cls/ holds the config file)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
def test_a_network_without_its_classifier_returns_its_pooled_features(name):
    """DINO's backbone pass is the network's own call (what ``model.compile`` compiles): with the classifier dropped
    it equals ``pooled_features`` bit for bit, in training mode with head dropout and stochastic depth drawn alike."""
    kwargs = ({"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2} if name.startswith("vit")
              else {"img_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [2, 2], "num_heads": [1, 2], "window_size": 4})
    torch.manual_seed(0)
    model = models.build_model(name, num_classes=3, in_chans=1, drop_rate=0.3, drop_path_rate=0.2, **kwargs)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    models.drop_classifier(model)
    model.train()
    x = torch.randn(4, 1, 32, 32)
    torch.manual_seed(7)
    own = model(x)
    torch.manual_seed(7)
    pooled = models.pooled_features(model, x)
    assert torch.equal(own, pooled) and own.shape == (4, models.feature_dim(model))


@pytest.mark.slow
def test_with_model_compile_the_student_trains_through_the_compiled_network():
    """``model.compile`` reaches DINO's student (it once compiled a call DINO never made): the student's passes run
    through dynamo, the teacher's do not, and the outputs equal the uncompiled module's."""
    import copy

    import torch._dynamo
    import torch._dynamo.utils

    torch.manual_seed(3)
    plain = DINOModule(**DINO_TINY)
    for p in plain.parameters():
        p.data.normal_(0, 0.3)
    plain.model.eval(), plain.teacher_model.eval()  # (no stochastic depth: the two modules' draws need not align)
    compiled = copy.deepcopy(plain)
    compiled.compile_options = {"backend": "aot_eager"}
    torch._dynamo.reset()
    compiled.configure_model()
    assert models.is_compiled(compiled.model) and not models.is_compiled(compiled.teacher_model)
    views = plain.multicrop(torch.randn(4, 1, 32, 32), generator=torch.Generator().manual_seed(0))
    start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = compiled.dino_outputs(views)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - start >= 1
    want = plain.dino_outputs(views)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
