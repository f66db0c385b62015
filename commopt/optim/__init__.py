"""The optimizers, one per module, their typed configs and the options they share."""

from commopt.optim.base import CompressedOptimizer
from commopt.optim.config import (
    CommOptions,
    OnebitAdamConfig,
    OnebitLambConfig,
    ZeroOneAdamConfig,
)
from commopt.optim.onebit_adam import OnebitAdam
from commopt.optim.onebit_lamb import OnebitLamb
from commopt.optim.zero_one_adam import ZeroOneAdam

__all__ = [
    "CommOptions",
    "CompressedOptimizer",
    "OnebitAdam",
    "OnebitAdamConfig",
    "OnebitLamb",
    "OnebitLambConfig",
    "ZeroOneAdam",
    "ZeroOneAdamConfig",
]
