"""Experiments of issue 13: auto freeze, tracking trust ratios, EControl, the step guard."""
