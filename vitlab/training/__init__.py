"""Lightning glue for fine-tuning: the classification module."""

from vitlab.training.module import ClassificationModule, warmup_cosine

__all__ = ["ClassificationModule", "warmup_cosine"]
