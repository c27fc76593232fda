"""Recovery after pruning: fine-tuning on `transformers.Trainer` (PEFT LoRA or full, optional distillation) and
Trainer callbacks that keep (`SparsityCallback`) or create (`PruningCallback`) sparsity during training."""

from .callbacks import PruningCallback, cubic_sparsity
from .config import FinetuneConfig, FinetuneReport
from .engine import DistillationTrainer
from .sparsity import SparsityCallback, merge_masked_, sparsity_masks
from .trainer import finetune_

__all__ = [
    "DistillationTrainer",
    "FinetuneConfig",
    "FinetuneReport",
    "PruningCallback",
    "SparsityCallback",
    "cubic_sparsity",
    "finetune_",
    "merge_masked_",
    "sparsity_masks",
]
