"""Prefill and decode workers: the same engine in different roles."""
