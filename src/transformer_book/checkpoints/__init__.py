"""Checkpoints made by the package's own recipes (scripts/make_checkpoints.py); read with trained_model()."""
