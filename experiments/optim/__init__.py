"""Optimizer step-time benchmark (see bench_step.py)."""
