"""Kernel sources written once and shared by backends (Triton, TVM). Kernels never import
backends: a backend imports kernels and passes them launch parameters."""
