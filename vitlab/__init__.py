"""vitlab: fine-tune Vision Transformers on medical images and see inside them while they learn."""

import os

# albumentations asks PyPI for its latest version whenever it is imported, unless told not to: a request from every
# process that loads data (a training run, its DDP processes, a study's runs), up to seconds each where the network
# is slow or closed (a warning where it is missing), and no request a hospital's machine should make. Its authors ask
# libraries built on it to turn the check off; a value the user set is kept.
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

__version__ = "0.1.0"
