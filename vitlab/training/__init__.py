"""Lightning glue: one module per task (classification, detection, segmentation, DINO pretraining)."""

from vitlab.training.base import TaskModule, warmup_cosine
from vitlab.training.detection import DetectionModule
from vitlab.training.dino import DINOModule
from vitlab.training.classification import ClassificationModule
from vitlab.training.segmentation import SegmentationModule

__all__ = ["ClassificationModule", "DetectionModule", "SegmentationModule", "TaskModule", "DINOModule", "warmup_cosine"]
