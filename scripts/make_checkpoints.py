"""Make the checkpoints shipped inside the package (src/transformer_book/checkpoints/).

    python scripts/make_checkpoints.py            # every recipe that ships a checkpoint

Each is trained on the CPU by the package's own recipe with seed 0 (`train_recipe`: it stops
on the validation set, then scores the test set once; both scores are stored),
saved with only tensors, strings and numbers (so `torch.load(weights_only=True)` reads
it), and its SHA-256 is written to SHA256SUMS, which `trained_model` checks on loading.
Run it again whenever a recipe changes: `trained_model` refuses a checkpoint whose
stored recipe differs from today's, and tests/test_recipes.py retrains the recipe to
check it still reaches the target the shipped checkpoint claims.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch

import transformer_book as tb
from transformer_book.recipes import checkpoint_digest, checkpoint_state

FOLDER = Path(__file__).resolve().parent.parent / "src" / "transformer_book" / "checkpoints"
SHIPPED = ("dates",)


def main() -> int:
    torch.set_num_threads(1)
    sums = {}
    for name in SHIPPED:
        trained = tb.train_recipe(name, seed=0, device=torch.device("cpu"), progress=True)
        # Training stopped when the validation set reached the target; the test set,
        # scored once afterwards, must come close (within 1%) to show the model learned.
        assert trained.validation >= trained.recipe.target, (name, trained.validation)
        assert trained.accuracy >= trained.recipe.target - 0.01, (name, trained.accuracy)
        buffer = io.BytesIO()
        torch.save(checkpoint_state(trained), buffer)
        data = buffer.getvalue()
        (FOLDER / f"{name}.pt").write_bytes(data)
        sums[f"{name}.pt"] = checkpoint_digest(data)
        print(
            f"{name}: exact match {trained.validation:.4f} (validation), {trained.accuracy:.4f} (test) "
            f"after {trained.steps} steps; {len(data) / 1024:.0f} KiB"
        )
    (FOLDER / "SHA256SUMS").write_text("".join(f"{digest}  {file}\n" for file, digest in sorted(sums.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
