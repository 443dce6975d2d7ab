"""Benchmarks: numbers measured side by side in one run, printed as JSON."""
