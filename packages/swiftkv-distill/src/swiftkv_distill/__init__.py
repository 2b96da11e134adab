"""swiftkv_distill: knowledge-preserving SwiftKV distillation on PyTorch Lightning (one CPU to a GPU cluster)."""

from .build import build_swiftkv_model
from .data import DataError
from .datamodule import DistillDataModule
from .export import export
from .module import SwiftKVDistillation
from .step import DistillationStep, LossSettings

__all__ = [
    "DataError",
    "DistillDataModule",
    "DistillationStep",
    "LossSettings",
    "SwiftKVDistillation",
    "build_swiftkv_model",
    "export",
]
