"""Samples -> tensors: the torch ``Dataset`` classes the data modules build, one module per kind of item.

- :mod:`~vitlab.data.datasets.images`: :class:`MedicalImageDataset`, ``(image (C, S, S), label)`` from 2-D files,
  slices and slabs;
- :mod:`~vitlab.data.datasets.targets`: :class:`DenseDataset`, images with masks, boxes and instances
  (detection, segmentation);
- :mod:`~vitlab.data.datasets.slices`: :class:`VolumeStore`, the bounded store slices and slabs are cut from;
- :mod:`~vitlab.data.datasets.volumes`: :class:`VolumeDataset`, whole volumes ``(1, I, J, K)`` and their label maps.
"""
