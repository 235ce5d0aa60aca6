"""Placeholder: the nvfuser backend lands here (registers nothing yet)."""
