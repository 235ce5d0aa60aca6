"""Placeholder: the cublaslt backend lands here (registers nothing yet)."""
