"""Tensor kernels: CPU references and their CUDA counterparts."""
