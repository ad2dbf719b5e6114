"""LightningModule for DINO self-supervised pretraining (the Veta lecture), labels ignored for training."""

from __future__ import annotations

import copy
from typing import Any

import torch
from lightly.loss import DINOLoss
from lightly.models.modules import DINOProjectionHead
from lightly.models.utils import deactivate_requires_grad, update_momentum
from lightly.utils.scheduler import cosine_schedule

from vitlab import models
from vitlab.analysis import weighted_knn
from vitlab.data.multicrop import MultiCrop
from vitlab.training.base import TaskModule


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) along the last dimension of probabilities ``p``."""
    return -(p * p.clamp_min(1e-30).log()).sum(dim=-1)


def teacher_temperature(epoch: int, start: float, end: float, warmup_epochs: int) -> float:
    """DINO's teacher temperature: linear from ``start`` at epoch 0 to ``end`` at ``warmup_epochs``, then ``end``."""
    if epoch >= warmup_epochs:
        return end
    return start + (end - start) * epoch / warmup_epochs


class DINOModule(TaskModule):
    """DINO: a student (``self.model`` backbone + ``self.head``) learns to match an EMA teacher
    (``self.teacher_model`` + ``self.teacher_head``) across multi-crop views; labels are ignored for training.

    The Q/K/V callbacks see the student backbone (``module.model``). Loss, centring and the teacher temperature
    come from ``lightly.loss.DINOLoss``; projection heads from ``lightly``'s ``DINOProjectionHead``; the teacher
    follows ``update_momentum`` with λ on a cosine schedule ``momentum_start -> momentum_end`` over the run.
    Logged: ``train/loss``, ``dino/teacher_entropy_mean`` (entropy of the batch-mean teacher distribution:
    near log K = uniform collapse), ``dino/teacher_entropy`` (mean per-sample entropy: near 0 = one-hot
    collapse), ``dino/center_norm``, ``dino/teacher_temp``, ``dino/momentum``, and every ``knn_every_n_epochs``
    ``val/knn_acc`` / ``val/knn_balanced_acc``: DINO's weighted k-NN on the teacher's pooled features
    (train split without augmentation -> val split), when the data has labels; their best values go to the
    hparams table (``hp/best_val_knn_acc``). Under DDP each rank computes the features of its share of both
    splits, and every rank scores the gathered whole (same value on all ranks; the centre is all-reduced by lightly).

    Args:
        num_classes: Classes of the data (linked; used by the k-NN evaluation only).
        class_names: Class names of the data (linked; used by the k-NN evaluation only).
        out_dim: Prototypes K of the projection head (its output width).
        hidden_dim: Width of the projection head's hidden layers.
        bottleneck_dim: Width of the projection head's bottleneck before the prototypes.
        head_batch_norm: BatchNorm in the head's MLP (DINO uses it for ResNets; it keeps tiny runs on small data
            from collapsing to uniform).
        local_crops: Local views per image, beside the two global ones.
        global_size: Side of the global views; None: the backbone's input size.
        local_size: Side of the local views; None: half the global side (at least 8).
        global_scale: Area fraction range of the global crops.
        local_scale: Area fraction range of the local crops.
        contrast: Contrast factor drawn from [1 - contrast, 1 + contrast], brightness shift from [-contrast, contrast].
        noise: Largest standard deviation of the Gaussian noise on each view (normalised units; drawn from [0, noise]).
        student_temp: Temperature of the student's softmax.
        teacher_temp: Teacher temperature after its warm-up.
        warmup_teacher_temp: Teacher temperature at epoch 0.
        warmup_teacher_temp_epochs: Epochs of the linear teacher-temperature warm-up (>= 1).
        center_momentum: EMA momentum of the centre subtracted from the teacher's outputs.
        momentum_start: Teacher EMA momentum λ at the first step.
        momentum_end: Teacher EMA momentum λ at the last step (cosine schedule between them).
        freeze_last_layer: Epochs during which the head's last layer does not train.
        lr: Peak learning rate (DINO's default).
        weight_decay: AdamW weight decay of the decayed groups (DINO's default).
        knn_every_n_epochs: k-NN evaluation every this many epochs (0: off).
        knn_k: Neighbours of the weighted k-NN.
        knn_temperature: Temperature of the k-NN's similarity weights.
        **kwargs: The other backbone and optimiser arguments of :class:`~vitlab.training.base.TaskModule`
            (``ablate`` / ``freeze`` / ``layer_decay`` act on the student backbone; the teacher copies it).
    """

    task = "dino"
    shardable = False  # (its EMA teacher follows the student parameter by parameter: not written for sharded ones)

    def __init__(
        self,
        num_classes: int = 2,
        class_names: list[str] | None = None,
        out_dim: int = 1024,
        hidden_dim: int = 256,
        bottleneck_dim: int = 64,
        head_batch_norm: bool = False,
        local_crops: int = 4,
        global_size: int | None = None,
        local_size: int | None = None,
        global_scale: tuple[float, float] = (0.4, 1.0),
        local_scale: tuple[float, float] = (0.1, 0.4),
        contrast: float = 0.3,
        noise: float = 0.05,
        student_temp: float = 0.1,
        teacher_temp: float = 0.07,
        warmup_teacher_temp: float = 0.04,
        warmup_teacher_temp_epochs: int = 10,
        center_momentum: float = 0.9,
        momentum_start: float = 0.996,
        momentum_end: float = 1.0,
        freeze_last_layer: int = 1,
        lr: float = 5e-4,
        weight_decay: float = 0.04,
        knn_every_n_epochs: int = 1,
        knn_k: int = 20,
        knn_temperature: float = 0.07,
        **kwargs: Any,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, **kwargs)
        if not 0.0 <= momentum_start <= momentum_end <= 1.0:
            raise ValueError(f"model.momentum_start / momentum_end must satisfy 0 <= start <= end <= 1, got {momentum_start}, {momentum_end}")
        if warmup_teacher_temp_epochs < 1:
            raise ValueError(f"model.warmup_teacher_temp_epochs must be >= 1, got {warmup_teacher_temp_epochs}")
        backbone = self.backbone_args
        self.model = self.build_network("build_model", name=backbone.model_name,
                                        num_classes=max(num_classes, 2),  # (its classifier is dropped)
                                        in_chans=backbone.in_chans, pretrained=backbone.pretrained,
                                        weights=backbone.weights, **backbone.model_kwargs)
        models.drop_classifier(self.model)
        self._intervene()
        dim = models.feature_dim(self.model)
        self.head = DINOProjectionHead(dim, hidden_dim, bottleneck_dim, out_dim, batch_norm=head_batch_norm, freeze_last_layer=freeze_last_layer)
        self.teacher_model = copy.deepcopy(self.model)
        self.teacher_head = DINOProjectionHead(dim, hidden_dim, bottleneck_dim, out_dim, batch_norm=head_batch_norm)
        self.teacher_head.load_state_dict(self.head.state_dict())
        deactivate_requires_grad(self.teacher_model)
        deactivate_requires_grad(self.teacher_head)
        self.criterion = DINOLoss(output_dim=out_dim, warmup_teacher_temp=warmup_teacher_temp, teacher_temp=teacher_temp,
                                  warmup_teacher_temp_epochs=warmup_teacher_temp_epochs, student_temp=student_temp,
                                  center_momentum=center_momentum)  # its ``center`` buffer is in the checkpoint
        size = global_size or models.input_size(self.model)[1]
        self.multicrop = MultiCrop(global_size=size, local_size=local_size or max(size // 2, 8), local_crops=local_crops,
                                   global_scale=tuple(global_scale), local_scale=tuple(local_scale), contrast=contrast, noise=noise)
        self._val_features: list[torch.Tensor] = []
        self._val_labels: list[torch.Tensor] = []
        self._momenta: list[float] = []  # this epoch's EMA momentum per step (logged as their mean)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, C, H, W) -> (B, D) student features
        return models.pooled_features(self.model, images)

    def teacher_temp(self) -> float:
        h = self.hparams
        return teacher_temperature(self.current_epoch, h.warmup_teacher_temp, h.teacher_temp, h.warmup_teacher_temp_epochs)

    def momentum(self) -> float:
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        return cosine_schedule(min(self.global_step, total), total, self.hparams.momentum_start, self.hparams.momentum_end)

    def dino_outputs(self, views: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(teacher outputs of the 2 global views, student outputs of all views), each (B, K).

        Like DINO's ``MultiCropWrapper``, the backbones see the views of one size as one batch (fewer, larger
        matrix products: ~10 % faster here; every sample is still processed on its own, stochastic depth
        included); the head then runs per view, so its batch-norm statistics stay per view."""
        with torch.no_grad():
            teacher = [self.teacher_head(f) for f in self._by_size(self.teacher_model, views[:2])]
        student = [self.head(f) for f in self._by_size(self.model, views)]
        return teacher, student

    @staticmethod
    def _by_size(model, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pooled features of every view, one backbone pass per distinct view size.

        The pass is the network's own call: with its classifier dropped (:func:`vitlab.models.drop_classifier`) a
        timm network returns :func:`vitlab.models.pooled_features` (the same operations: its head is the identity),
        and ``model.compile`` compiles that call; the student trains through it. (The teacher stays uncompiled:
        the momentum update gives its weights new storage at every step, which CUDA graphs would record again.)"""
        out: list[torch.Tensor | None] = [None] * len(views)
        sizes: dict[tuple, list[int]] = {}
        for i, v in enumerate(views):
            sizes.setdefault(tuple(v.shape[1:]), []).append(i)
        for idx in sizes.values():
            feats = model(torch.cat([views[i] for i in idx]))
            for i, f in zip(idx, feats.split([len(views[i]) for i in idx])):
                out[i] = f
        return out

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch  # labels ignored
        views = self.multicrop(images)
        teacher, student = self.dino_outputs(views)
        temp = self.teacher_temp()
        with torch.no_grad():
            center = self.criterion.center.detach().clone()
            probs = torch.softmax((torch.stack(teacher) - center) / temp, dim=-1)  # (2, B, K)
        loss = self.criterion(teacher, student, teacher_temp=temp)
        n = len(images)
        self.log_batch("train/loss", loss, on_step=True, on_epoch=True, batch_size=n)
        self.log_batch("dino/teacher_entropy", entropy(probs).mean(), on_step=False, on_epoch=True, batch_size=n, sync_dist=True)
        self.log_batch("dino/teacher_entropy_mean", entropy(probs.mean(dim=(0, 1))), on_step=False, on_epoch=True, batch_size=n, sync_dist=True)
        self.log_batch("dino/center_norm", self.criterion.center.norm(), on_step=False, on_epoch=True, batch_size=n, sync_dist=True)
        return loss

    def on_train_epoch_start(self) -> None:
        # the teacher runs without stochastic depth / dropout (DINO builds it without drop_path)
        self.teacher_model.eval()  # (the head keeps train mode: with head_batch_norm it normalises by batch statistics)
        self._momenta: list[float] = []

    def on_train_epoch_end(self) -> None:
        """The epoch's teacher temperature and mean EMA momentum: Python numbers, logged once per epoch (a number logged
        each step would be copied to the device each step, which waits for it)."""
        self.log("dino/teacher_temp", self.teacher_temp(), sync_dist=True)
        momenta = getattr(self, "_momenta", [])
        if momenta:
            self.log("dino/momentum", sum(momenta) / len(momenta), sync_dist=True)

    def on_after_backward(self) -> None:
        self.head.cancel_last_layer_gradients(self.current_epoch)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        m = self.momentum()
        update_momentum(self.model, self.teacher_model, m)
        update_momentum(self.head, self.teacher_head, m)
        self._momenta.append(m)

    def setup(self, stage: str) -> None:
        every = self.hparams.knn_every_n_epochs
        for cb in getattr(self.trainer, "checkpoint_callbacks", []):
            if cb.monitor and cb.monitor.startswith("val/knn") and (not every or getattr(cb, "_every_n_epochs", 1) % every):
                raise ValueError(f"checkpoint.monitor {cb.monitor} is logged every model.knn_every_n_epochs = {every} epochs: "
                                 f"set checkpoint.every_n_epochs to a multiple of it (or knn_every_n_epochs: 1)")

    def _knn_due(self) -> bool:
        every = self.hparams.knn_every_n_epochs
        return bool(every) and not self.trainer.sanity_checking and (self.current_epoch + 1) % every == 0

    def validation_step(self, batch, batch_idx: int) -> None:
        if not self._knn_due() or not isinstance(batch, (tuple, list)):
            return
        images, labels = batch
        self._val_features.append(models.pooled_features(self.teacher_model, images).float().cpu())
        self._val_labels.append(labels.cpu())

    def on_validation_epoch_end(self) -> None:
        if not self._val_features:  # the same on every rank: a DistributedSampler gives each rank >= 1 batch
            return
        val_x, val_y = torch.cat(self._val_features), torch.cat(self._val_labels)
        self._val_features, self._val_labels = [], []
        loader = self.trainer.val_dataloaders
        if isinstance(getattr(loader, "sampler", None), torch.utils.data.DistributedSampler):  # DDP: this rank's share
            val_x, val_y = self._gather_shards(val_x, len(loader.dataset)), self._gather_shards(val_y, len(loader.dataset))
        train_x, train_y = self.train_bank()
        score = weighted_knn(train_x, train_y, val_x, val_y, k=self.hparams.knn_k, temperature=self.hparams.knn_temperature)
        values = {"val/knn_acc": score.accuracy, "val/knn_balanced_acc": score.balanced_accuracy}
        self._track_best(values)
        self.log_dict(values, sync_dist=True)  # every rank scored the same gathered features: checkpointers agree

    @torch.no_grad()
    def train_bank(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher features of the train split without augmentation (the k-NN memory bank); under DDP each rank
        computes its share and every rank gets the whole bank."""
        dm = self.trainer.datamodule
        dataset = dm.dataset("train", augmented=False, labelled_only=True)  # (not data.unlabelled_root's images)
        world = self.trainer.world_size
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=self.global_rank, shuffle=False) if world > 1 else None
        loader = torch.utils.data.DataLoader(dataset, batch_size=getattr(dm, "batch_size", 32), sampler=sampler)
        feats, labels = [], []
        for images, y in loader:
            feats.append(models.pooled_features(self.teacher_model, images.to(self.device)).float().cpu())
            labels.append(y)
        return self._gather_shards(torch.cat(feats), len(dataset)), self._gather_shards(torch.cat(labels), len(dataset))

    def _gather_shards(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """Rows a ``DistributedSampler`` dealt out (rank r holds rows r, r + W, r + 2W ...) back in dataset order on
        every rank, without the sampler's padding (the repeats it adds after row ``total``). One process: ``x``."""
        world = self.trainer.world_size
        if world == 1:
            return x
        x = x.to(self.device)  # (NCCL gathers device tensors)
        counts = self.all_gather(torch.tensor(len(x), device=self.device)).reshape(world)
        width = int(counts.max())
        padded = torch.cat([x, x.new_zeros((width - len(x), *x.shape[1:]))])
        rows = self.all_gather(padded).transpose(0, 1).reshape(world * width, *x.shape[1:])  # row j * W + r
        kept = (torch.arange(width, device=self.device)[:, None] < counts[None, :]).reshape(-1)
        return rows[kept][:total].cpu()

    def optimizer_groups(self) -> list[dict]:
        """The backbone's groups (the base's), then the projection head's: decay on matrices, none on biases / norms."""
        groups = super().optimizer_groups()
        head_params = [p for p in self.head.parameters() if p.requires_grad]
        groups.append({"params": [p for p in head_params if p.ndim > 1], "weight_decay": self.hparams.weight_decay})
        groups.append({"params": [p for p in head_params if p.ndim <= 1], "weight_decay": 0.0})
        return groups
