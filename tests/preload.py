"""The libraries the chapters import, imported once by a process that then forks a child
per notebook (tests/forked_kernels.py) or per section (tests/section_runner.py), so that
each child starts with them loaded, as a fresh kernel would after its first cells.

Nothing here computes with torch, so no thread pool exists yet when the parent forks; and
should an import ask whether there is a GPU, NVML answers: CUDA's own answer initialises
the driver, which a forked child could not use.
"""

from __future__ import annotations

import importlib
import os
import sys

LIBRARIES = (
    "altair",
    "numpy",
    "pandas",
    "matplotlib.pyplot",
    "seaborn",  # with scipy.stats: a second per child if each imported it
    "torch",
    "torch._dynamo",  # torch.optim.Adam() imports it: a second in every run that trains
    "transformer_book",
    "transformer_book.book.diagrams",
    "transformer_book.book.viz",
)
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def import_libraries(*more: str, plots: str) -> None:
    """Import ``LIBRARIES`` and ``more``, with matplotlib's backend ``plots`` unless
    ``$MPLBACKEND`` names one. Raises if an import initialised CUDA."""
    os.environ.setdefault("MPLBACKEND", plots)
    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        for name in (*LIBRARIES, *more):
            importlib.import_module(name)
        torch = sys.modules["torch"]
        if torch.distributed.is_available():  # torch.testing.assert_close's first call: 0.7 s
            importlib.import_module("torch.distributed.tensor")
    finally:
        if before is None:
            del os.environ[NVML_CHECK]
        else:
            os.environ[NVML_CHECK] = before
    if torch.cuda.is_initialized():
        raise RuntimeError("an import initialised CUDA: a forked child could not use it")
