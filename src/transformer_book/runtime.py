"""Where the code runs and how it is made repeatable: device, seed, versions, glue."""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import shutil
import warnings
from typing import Any

import numpy as np
import torch

from .checks import as_device, require_instance

DEVICE_ENV = "TRANSFORMER_BOOK_DEVICE"
SEED_ENV = "TRANSFORMER_BOOK_SEED"


def get_device() -> torch.device:
    """The device chapters and tests run on.

    ``TRANSFORMER_BOOK_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``, ``mps``) forces one;
    forcing an accelerator that is not there raises, so a GPU job can never pass on
    a CPU by accident. Without the variable: CUDA, then Apple's MPS, then the CPU.
    """
    forced = os.environ.get(DEVICE_ENV, "").strip()
    if forced:
        try:
            device = torch.device(forced)
        except RuntimeError as error:
            raise ValueError(
                f"{DEVICE_ENV}={forced!r} is not a device name ({error})"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                f"{DEVICE_ENV}={forced!r} but torch.cuda.is_available() is False"
            )
        if (
            device.type == "cuda"
            and device.index is not None
            and device.index >= torch.cuda.device_count()
        ):
            raise RuntimeError(
                f"{DEVICE_ENV}={forced!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
            )
        if device.type == "mps" and not torch.backends.mps.is_available():
            raise RuntimeError(
                f"{DEVICE_ENV}={forced!r} but torch.backends.mps.is_available() is False"
            )
        if device.type not in {"cpu", "cuda", "mps"}:
            raise ValueError(f"{DEVICE_ENV}={forced!r}: expected cpu, cuda[:N] or mps")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def compile_unavailable(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot build kernels for ``device`` here, or None if it can.

    Inductor writes C++ for a CPU, which needs a C++ compiler (``$CXX``, ``c++``, ``g++`` or
    ``clang++``), and Triton for a CUDA GPU. Other devices run eagerly.
    """
    if device.type == "cpu":
        names = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
        if not any(name and shutil.which(name) for name in names):
            return "no C++ compiler was found ($CXX, c++, g++ or clang++)"
        return None
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed"
    return f"torch.compile is not used on {device.type} here"


def compile_model(
    module: torch.nn.Module, device: torch.device | str | None = None, **options: Any
) -> torch.nn.Module:
    """``torch.compile(module, fullgraph=True, **options)`` where kernels can be built for
    ``device`` (the module's, by default); elsewhere ``module`` itself, eager, with a warning
    that says why. ``fullgraph=True``: a break in the graph is an error, not a silent slowdown.

    On a CPU it also sets Inductor's ``fallback_random`` (``torch.compile``'s
    ``options``, unless ``mode`` is given): dropout then draws its masks from PyTorch's own
    generator, as eager does, and not from Inductor's Philox, which its C++ computes one
    number at a time, more slowly. So a compiled training step on a CPU drops what the eager
    step drops, seed for seed. On a GPU, Inductor draws them inside its fused kernels, the
    faster way there, and other masks than eager's.
    """
    require_instance(module, "module", torch.nn.Module)
    if device is None:
        parameter = next(iter(module.parameters()), None)
        if parameter is None:
            raise ValueError(
                "module has no parameters to take its device from: pass device"
            )
        device = parameter.device
    device = as_device(device)
    reason = compile_unavailable(device)
    if reason is not None:
        warnings.warn(f"running eagerly: {reason}", stacklevel=2)
        return module
    if device.type == "cpu" and "mode" not in options:
        options["options"] = {"fallback_random": True, **options.get("options", {})}
    return torch.compile(module, **{"fullgraph": True, **options})


def book_seed(default: int = 0) -> int:
    """The seed a chapter runs with: ``default``, unless ``TRANSFORMER_BOOK_SEED`` says otherwise.

    Every random draw in the book derives from this one number, so
    ``TRANSFORMER_BOOK_SEED=7 jupyter nbconvert --execute ...`` reruns a chapter with
    other randomness throughout (the test suite does exactly that).
    """
    text = os.environ.get(SEED_ENV, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{SEED_ENV}={text!r} is not an integer seed") from None


def seed_everything(seed: int | None = None) -> int:
    """Seed Python, NumPy and PyTorch (every device); returns the seed used.

    Without an argument the seed is :func:`book_seed`'s: 0, or ``TRANSFORMER_BOOK_SEED``
    when it is set. So ``SEED = seed_everything()`` at the top of a chapter is the one
    place its randomness comes from, and a later ``seed_everything(SEED + k)`` (or a
    generator seeded with ``SEED + k``) derives from it. An explicit seed is used as given.
    """
    seed = book_seed() if seed is None else seed
    require_instance(seed, "seed", int)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds CUDA and MPS generators
    return seed


def describe_environment(device: torch.device | str | None = None) -> str:
    """One line with the device and the library versions, printed at the top of each chapter."""
    device = get_device() if device is None else as_device(device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    return (
        f"device: {device} ({name}) | python {platform.python_version()} | torch {torch.__version__} "
        f"| numpy {np.__version__}"
    )


def glue(name: str, value: Any, display: bool = False) -> Any:
    """Hand ``value`` to the book's text under ``name`` (myst-nb's ``glue``).

    NumPy and one-element PyTorch values become plain Python numbers first, so a
    format such as ``{glue:text}`name:.2f``` applies. Outside a Jupyter Book build
    (Colab, a reader's notebook) myst-nb may be missing; then nothing is glued and
    the value is simply returned.
    """
    if isinstance(value, (np.generic, torch.Tensor)) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        return value
    myst_glue(name, value, display=display)
    return value
