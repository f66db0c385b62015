"""The optimizers, one per module."""

from commopt.optim.base import CompressedOptimizer
from commopt.optim.onebit_adam import OnebitAdam

__all__ = ["CompressedOptimizer", "OnebitAdam"]
