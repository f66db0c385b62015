"""Commodity-TCP step-time benchmark (see bench.py)."""
