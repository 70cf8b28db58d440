"""Differentiable functions below both ``nn`` and ``kernels``: the math the kernels are checked against."""
