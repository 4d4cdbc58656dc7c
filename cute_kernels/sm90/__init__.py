"""Hopper (SM90a) kernels."""
