"""specops.kernels."""
