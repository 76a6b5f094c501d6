"""GRU baselines of chapter 0 (scripts/make_baselines.py); read with transformer_book.recurrent.trained_baseline()."""
