"""Convergence suite (see run.py)."""
