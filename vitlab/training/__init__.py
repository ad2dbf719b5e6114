"""Lightning glue for fine-tuning: one module per task over a shared base."""

from vitlab.training.base import TaskModule, warmup_cosine
from vitlab.training.detection import DetectionModule
from vitlab.training.module import ClassificationModule
from vitlab.training.segmentation import SegmentationModule

__all__ = ["ClassificationModule", "DetectionModule", "SegmentationModule", "TaskModule", "warmup_cosine"]
