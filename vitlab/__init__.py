"""vitlab: fine-tune Vision Transformers on medical images and see inside them while they learn."""

__version__ = "0.1.0"
