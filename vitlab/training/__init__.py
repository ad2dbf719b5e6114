"""Lightning glue: the classification module and the DINO pretraining module."""

from vitlab.training.module import ClassificationModule, warmup_cosine

__all__ = ["ClassificationModule", "DINOModule", "warmup_cosine"]


def __getattr__(name: str):
    if name == "DINOModule":  # imported lazily: it needs the optional `lightly` package
        from vitlab.training.dino import DINOModule

        return DINOModule
    raise AttributeError(name)
