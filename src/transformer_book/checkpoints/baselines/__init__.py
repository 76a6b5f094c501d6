"""GRU baselines of chapter 0 (scripts/make_baselines.py).

Read with transformer_book.book.recurrent.trained_baseline()."""
