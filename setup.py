"""Packaging that setup.cfg cannot say: the top-level ``configs/`` folder ships inside the package as ``vitlab/configs``.

One source: the repository keeps its configs at the top level, and the wheel maps that folder onto the
``vitlab.configs`` package (``package_dir``), so ``vitlab-train --config quickstart`` finds them from any folder
(:func:`vitlab.cli_support.config_dirs`). Everything else lives in setup.cfg.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["vitlab", "vitlab.*"]), "vitlab.configs"],
    package_dir={"vitlab.configs": "configs"},
    package_data={"vitlab.configs": ["*.yaml"]},
)
