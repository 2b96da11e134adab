"""swiftkv_distill: knowledge-preserving SwiftKV distillation on PyTorch Lightning (one CPU to a GPU cluster)."""

from .data import DataError, DistillDataModule
from .module import DistillationStep, SwiftKVDistillation, build_swiftkv_model, export

__all__ = [
    "DataError",
    "DistillDataModule",
    "DistillationStep",
    "SwiftKVDistillation",
    "build_swiftkv_model",
    "export",
]
