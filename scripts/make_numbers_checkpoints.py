"""Make chapter 11's checkpoints (src/transformer_book/checkpoints/numbers/).

    python scripts/make_numbers_checkpoints.py            # all three
    python scripts/make_numbers_checkpoints.py uniform    # only those named

The encoder-decoder is trained by `numbers.train_numbers` with seed 0 (it stops when
its exact match on the validation set reaches `numbers.RECIPE.target`); the decoder-only model by
`numbers.train_numbers(decoder_only=True)` with the same seed, batch size and steps;
"uniform" is the encoder-decoder trained for as many steps on numbers drawn uniformly
from the whole range (section 11.2's lesson about test sets).
Each file holds only tensors, strings and numbers (the tokenizer as its JSON text),
and its SHA-256 goes to that folder's SHA256SUMS, which `trained_numbers` checks.
"""

from __future__ import annotations

import hashlib
import io
import sys
from pathlib import Path

import torch

from transformer_book import numbers

FOLDER = Path(__file__).resolve().parent.parent / "src" / "transformer_book" / "checkpoints" / "numbers"


NAMES = ("encoder_decoder", "decoder_only", "uniform")


def main(names: list[str]) -> int:
    torch.set_num_threads(1)
    task = numbers.NumberTask()
    wanted = names or list(NAMES)
    first = numbers.train_numbers(0, task, progress=True) if "encoder_decoder" in wanted else None
    steps = (first or numbers.trained_numbers()).steps
    sums_file = FOLDER / "SHA256SUMS"
    old = sums_file.read_text().split() if sums_file.exists() else []
    sums = dict(zip(old[1::2], old[0::2]))
    for name in wanted:
        if name == "encoder_decoder":
            trained = first
        elif name == "decoder_only":
            trained = numbers.train_numbers(0, task, steps=steps, decoder_only=True)
        else:
            trained = numbers.train_numbers(0, task, uniform=True, steps=steps)
        buffer = io.BytesIO()
        torch.save(numbers.checkpoint_state(trained), buffer)
        data = buffer.getvalue()
        (FOLDER / f"{name}.pt").write_bytes(data)
        sums[f"{name}.pt"] = hashlib.sha256(data).hexdigest()
        print(f"{name}: {trained.steps} steps, {trained.seconds:.0f} s; {len(data) / 1024:.0f} KiB")
    sums_file.write_text("".join(f"{d}  {f}\n" for f, d in sorted(sums.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
