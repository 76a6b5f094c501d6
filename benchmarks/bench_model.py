"""One training step and one eval forward: the package's model against PyTorch's nn.Transformer.

Three models compute the same function with the same weights, in the same run:

- ``plain``: the model the chapters teach, plain PyTorch (``nn.Linear``, ``nn.Dropout``, the
  attention formula or ``F.scaled_dot_product_attention``);
- ``ours``: the same model after ``transformer_book.fast.accelerate(model)``, on the speed
  wing's CPU kernels (appendix C);
- ``theirs``: PyTorch's ``nn.Transformer``, its encoder and decoder layers holding a copy of
  our weights, between embeddings, positional encoding and an output layer of its own (a copy
  of ours).

All three train with the book's Adam (``tb.noam_optimizer``: PyTorch's fused Adam), dropout
0.1, in train mode, each with weights and optimiser state of its own. The achieved GFLOP/s is
printed next to a plain matmul's, measured in the same run: on a CPU the faster of PyTorch's two
matrix libraries at 2048², MKL (``a @ b``) and oneDNN, since the wing computes with oneDNN and
MKL is the slower of the two on some CPUs (a share of MKL's alone could then pass 100%).

How it is timed, so that the ratio means what it says: the models take turns, in the
order A B C C B A, step after step, so a slow drift of the machine (these are shared
machines) and the order itself hit all alike; each ratio reported is the median over
rounds of (model / nn.Transformer) within the round, with the lowest and highest round beside
it: ``ratio`` for ``ours`` (accelerated), ``plain_ratio`` for the plain model.
The paper's base sizes with a vocabulary of 1,000 (a vocabulary of 37,000 would make
the one identical output layer dominate both times).

    python benchmarks/bench_model.py                # base sizes, vocabulary 1,000, batch 8 x 64 tokens
    python benchmarks/bench_model.py --small        # a quick run

Only the default run writes the results file that appendix C shows.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import interleaved_medians, machine, print_table, synchronize, write_results
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import kernels
from transformer_book.parity import to_pytorch

#: What each name in the results stands for (written into the results file).
CONTENDERS = {
    "ours": "the package's model after transformer_book.fast.accelerate(model): the wing's CPU kernels",
    "plain": "the package's model as the chapters teach it: plain PyTorch",
    "theirs": "torch.nn.Transformer holding the same weights",
}


class PyTorchTransformer(nn.Module):
    """nn.Transformer between our embeddings and output layer, so both sides compute logits."""

    def __init__(self, ours: tb.Transformer) -> None:
        super().__init__()
        self.ours = ours
        self.core = to_pytorch(ours)

    def forward(self, src, tgt, src_mask, tgt_mask):
        # PyTorch's masks mean "blocked": flip ours.
        padding = tb.to_pytorch_mask(src_mask[:, 0, :])
        hidden = self.core(
            self.ours.positional(self.ours.src_embed(src)),
            self.ours.positional(self.ours.tgt_embed(tgt)),
            tgt_mask=tb.to_pytorch_mask(tgt_mask[0]),
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        return self.ours.generator(hidden)


def flops(fn) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def run(device: torch.device, config: tb.ModelConfig, batch: int, length: int, repeats: int) -> list[dict]:
    tb.seed_everything(0)
    plain = tb.make_model(config).to(device)
    ours = fast.accelerate(copy.deepcopy(plain))  # the same weights, on the wing's kernels
    theirs = PyTorchTransformer(plain).to(device)
    # Separate weights for each so that their optimisers do not share state.
    theirs.ours = copy.deepcopy(plain)

    src = torch.randint(1, config.src_vocab_size, (batch, length), device=device)
    tgt = torch.randint(1, config.tgt_vocab_size, (batch, length + 1), device=device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    src_mask, tgt_mask = tb.padding_mask(src), tb.causal_mask(length, device)
    models = {"ours": ours, "theirs": theirs, "plain": plain}
    # The book's optimiser for all three (noam_optimizer: PyTorch's fused Adam where it runs).
    optimisers = {name: tb.noam_optimizer(model, config.d_model, warmup=4000)[0] for name, model in models.items()}

    def train_step(name):
        model = models[name]

        def step():
            model.train()
            optimisers[name].zero_grad(set_to_none=True)
            logits = model(src, tgt_in, src_mask, tgt_mask)
            F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten()).backward()
            optimisers[name].step()

        return step

    def eval_forward(name):
        model = models[name]

        @torch.inference_mode()
        def forward():
            model.eval()
            model(src, tgt_in, src_mask, tgt_mask)

        return forward

    # Same outputs first: a benchmark of different computations would mean nothing.
    for model in models.values():
        model.eval()
    with torch.no_grad():
        expected = theirs(src, tgt_in, src_mask, tgt_mask)
        for name in ("ours", "plain"):
            torch.testing.assert_close(models[name](src, tgt_in, src_mask, tgt_mask), expected, atol=1e-4, rtol=1e-4)

    train_flops = flops(train_step("plain"))  # the same computation for all three
    eval_flops = flops(eval_forward("plain"))
    train = paired_ratios({name: train_step(name) for name in models}, device, repeats)
    evals = paired_ratios({name: eval_forward(name) for name in models}, device, repeats)

    matmuls = matmul_gflops(device, repeats)
    best = max(matmuls, key=matmuls.get)

    rows = []
    for label, times, work in (("train step (fwd+bwd+Adam)", train, train_flops), ("eval forward", evals, eval_flops)):
        rows.append({
            "device": device.type, "what": label, "ours_ms": times["ours"] * 1e3, "theirs_ms": times["theirs"] * 1e3,
            "ratio": times["ratio"], "ratio_min": times["ratio_min"], "ratio_max": times["ratio_max"],
            "plain_ms": times["plain"] * 1e3, "plain_ratio": times["plain_ratio"],
            "plain_ratio_min": times["plain_ratio_min"], "plain_ratio_max": times["plain_ratio_max"],
            "gflop": work / 1e9, "ours_gflops": work / times["ours"] / 1e9,
            "plain_gflops": work / times["plain"] / 1e9, "theirs_gflops": work / times["theirs"] / 1e9,
            "matmul_gflops": matmuls[best], "matmul_library": best,
            **{f"matmul_{name}_gflops": value for name, value in matmuls.items()},
            "tokens_per_s": batch * length / times["ours"], "plain_tokens_per_s": batch * length / times["plain"],
        })  # fmt: skip
    return rows


def matmul_gflops(device: torch.device, repeats: int) -> dict[str, float]:
    """GFLOP/s of one large matrix product (2048² on a CPU, 8192² on a GPU), the reference for
    the model's: on a CPU both libraries PyTorch ships, ``a @ b`` (MKL) and oneDNN (the
    wing's ``kernels.affine``, which does its products), since either may be the faster on
    a given CPU (MKL is slow on some AMD parts); on a GPU ``a @ b``."""
    n = 2048 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    fns = {"mkl" if device.type == "cpu" else device.type: lambda: a @ b}
    if device.type == "cpu" and kernels.applies_to(a):
        b_t = b.t().contiguous()  # affine multiplies by the transpose of its weight
        fns["onednn"] = lambda: kernels.affine(a, b_t)
    times = interleaved_medians(fns, device, repeats)
    return {name: 2 * n**3 / seconds / 1e9 for name, seconds in times.items()}


def paired_ratios(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, float]:
    """Time ``fns`` in rounds, in order and then in reverse (A B C C B A).

    Returns each one's median seconds, and for each but ``"theirs"`` the median, lowest
    and highest over rounds of its time over ``"theirs"``'s in the same round
    (``ratio``, ``ratio_min``, ``ratio_max`` for ``"ours"``; ``<name>_ratio`` and so on
    for the others).
    """
    for fn in fns.values():
        fn()
    order = [*fns.items(), *reversed(fns.items())]
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        spent = dict.fromkeys(fns, 0.0)
        for name, fn in order:
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            spent[name] += (time.perf_counter() - start) / 2
        for name in fns:
            times[name].append(spent[name])
    result = {name: statistics.median(seconds) for name, seconds in times.items()}
    for name in fns:
        if name != "theirs":
            ratios = [mine / base for mine, base in zip(times[name], times["theirs"], strict=True)]
            prefix = "" if name == "ours" else f"{name}_"
            result |= {f"{prefix}ratio": statistics.median(ratios), f"{prefix}ratio_min": min(ratios),
                       f"{prefix}ratio_max": max(ratios)}  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="ModelConfig.small and a short batch, for a quick check")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary size (shared, tied)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="rounds of A B C C B A")
    args = parser.parse_args()
    config = tb.ModelConfig.small(args.vocab) if args.small else tb.ModelConfig.base(args.vocab)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [row for device in devices for row in run(device, config, args.batch, args.length, args.repeats)]
    size = "small" if args.small else "base"
    title = (f"transformer_book (plain, and accelerated by fast.accelerate) vs nn.Transformer — {size} sizes, "
             f"vocabulary {args.vocab}, batch {args.batch} x {args.length} tokens, float32, "
             f"{args.repeats} rounds of A B C C B A")  # fmt: skip
    print_table(
        f"{title}\n{machine()}",
        ["what", "accelerated ms", "plain ms", "nn.Transformer ms", "accelerated / nn.Transformer (median, min-max)",
         "plain / nn.Transformer (median, min-max)", "GFLOP", "accelerated GFLOP/s", "plain GFLOP/s",
         "nn.Transformer GFLOP/s", "matmul GFLOP/s (faster library)", "accelerated / matmul"],
        [[f"{r['device']}: {r['what']}", f"{r['ours_ms']:.1f}", f"{r['plain_ms']:.1f}", f"{r['theirs_ms']:.1f}",
          f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
          f"{r['plain_ratio']:.3f} ({r['plain_ratio_min']:.3f}-{r['plain_ratio_max']:.3f})",
          f"{r['gflop']:.1f}", f"{r['ours_gflops']:.1f}", f"{r['plain_gflops']:.1f}", f"{r['theirs_gflops']:.1f}",
          f"{r['matmul_gflops']:.1f} ({r['matmul_library']})", f"{r['ours_gflops'] / r['matmul_gflops']:.0%}"]
         for r in rows],
    )  # fmt: skip
    if vars(args) == vars(parser.parse_args([])):  # appendix C reads the default run only
        write_results("model", {"title": title, "config": dataclasses.asdict(config), "contenders": CONTENDERS,
                                "wing": fast.status(), "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
