"""Chapter 11's two models (scripts/make_numbers_checkpoints.py); read with numbers.trained_numbers()."""
