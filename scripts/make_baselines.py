"""Make the shipped GRU baselines of chapter 0: python scripts/make_baselines.py

Trains ``BASELINES["gru"]`` and ``BASELINES["gru_attention"]`` on the dates task with
seed 0 (one CPU thread, a few minutes), writes ``<name>.pt`` into
src/transformer_book/checkpoints/baselines/ and their digests into its SHA256SUMS.
"""

from __future__ import annotations

import hashlib
import io
import time
from pathlib import Path

import torch

from transformer_book.book.recurrent import BASELINES, baseline_state, train_baseline

FOLDER = Path(__file__).resolve().parents[1] / "src" / "transformer_book" / "checkpoints" / "baselines"


def main() -> None:
    torch.set_num_threads(1)
    lines = []
    for name in BASELINES:
        start = time.perf_counter()
        trained = train_baseline(name, seed=0, device=torch.device("cpu"))
        buffer = io.BytesIO()
        torch.save(baseline_state(trained), buffer)
        data = buffer.getvalue()
        (FOLDER / f"{name}.pt").write_bytes(data)
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {name}.pt")
        seconds = time.perf_counter() - start
        print(f"{name}: held-out exact match {trained.accuracy:.3f}, {len(data) / 1e3:.0f} kB, {seconds:.0f} s")
    (FOLDER / "SHA256SUMS").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
