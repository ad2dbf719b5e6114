#!/usr/bin/env python
"""Fine-tune a Vision Transformer on medical images: ``python train.py --config configs/quickstart.yaml``."""

from vitlab.cli import train_main

if __name__ == "__main__":
    train_main()
