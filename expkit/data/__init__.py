"""The data layer: data modules that configs name (``_target_: expkit.data.DigitsData``).

- ``expkit.data.datasets``: the data module protocol (``DataModule``) and the data in memory or in
  a folder: scikit-learn's digits, random images, torchvision's ImageFolder layout.
- ``expkit.data.shards``: WebDataset tar shards on a disk or in object storage, read by index
  (``data=webdataset``); imported only by the runs that use them (it needs the ``shards`` extra).
"""

from expkit.data.datasets import (
    DataModule,
    DigitsData,
    FakeImageData,
    ImageFolderData,
    RandomImages,
    check_fractions,
    load_digits,
    preprocess,
    stratified_split,
)
from expkit.samplers import SeededRandomSampler, ShardSampler

__all__ = [
    "DataModule",
    "DigitsData",
    "FakeImageData",
    "ImageFolderData",
    "RandomImages",
    "SeededRandomSampler",
    "ShardSampler",
    "check_fractions",
    "load_digits",
    "preprocess",
    "stratified_split",
]
