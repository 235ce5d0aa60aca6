"""Placeholder: the inductor backend lands here (registers nothing yet)."""
