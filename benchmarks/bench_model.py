"""One training step and one eval forward: this package against PyTorch's nn.Transformer.

Both models compute the same function: the nn.Transformer gets PyTorch's own
encoder and decoder layers holding a copy of our weights, between embeddings,
positional encoding and an output layer of its own (a copy of ours). Both train with
Adam, dropout 0.1, in train mode. The achieved GFLOP/s is printed next to a plain
matmul's, measured in the same run.

How it is timed, so that the ratio means what it says: the two models take turns,
in the order A B B A, step after step, so a slow drift of the machine (these are
shared machines) and the order itself hit both alike; the ratio reported is the
median over rounds of (ours / theirs) within the round, with the lowest and highest
round beside it. The paper's base sizes with a vocabulary of 1,000 (a vocabulary of
37,000 would make the one identical output layer dominate both times).

    python benchmarks/bench_model.py                # base sizes, vocabulary 1,000, batch 8 x 64 tokens
    python benchmarks/bench_model.py --small        # a quick run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import torch.nn.functional as F
from common import interleaved_medians, machine, print_table, synchronize, write_results
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from transformer_book.parity import to_pytorch


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
    ours = tb.make_model(config).to(device)
    theirs = PyTorchTransformer(ours).to(device)
    # Separate weights for the baseline so the two optimisers do not share state.
    theirs.ours = tb.make_model(config).to(device)
    theirs.ours.load_state_dict(ours.state_dict())

    src = torch.randint(1, config.src_vocab_size, (batch, length), device=device)
    tgt = torch.randint(1, config.tgt_vocab_size, (batch, length + 1), device=device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    src_mask, tgt_mask = tb.padding_mask(src), tb.causal_mask(length, device)
    optimisers = {
        name: torch.optim.Adam(model.parameters(), lr=1e-4) for name, model in (("ours", ours), ("theirs", theirs))
    }

    def train_step(name, model):
        def step():
            model.train()
            optimisers[name].zero_grad(set_to_none=True)
            logits = model(src, tgt_in, src_mask, tgt_mask)
            F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten()).backward()
            optimisers[name].step()

        return step

    def eval_forward(model):
        @torch.inference_mode()
        def forward():
            model.eval()
            model(src, tgt_in, src_mask, tgt_mask)

        return forward

    # Same outputs first: a benchmark of two different computations would mean nothing.
    ours.eval(), theirs.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            ours(src, tgt_in, src_mask, tgt_mask), theirs(src, tgt_in, src_mask, tgt_mask), atol=1e-4, rtol=1e-4
        )

    train_flops = flops(train_step("ours", ours))
    eval_flops = flops(eval_forward(ours))
    train = paired_ratios(train_step("ours", ours), train_step("theirs", theirs), device, repeats)
    evals = paired_ratios(eval_forward(ours), eval_forward(theirs), device, repeats)

    n = 2048 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    matmul = interleaved_medians({"mm": lambda: a @ b}, device, repeats)["mm"]
    matmul_gflops = 2 * n**3 / matmul / 1e9

    rows = []
    for label, times, work in (("train step (fwd+bwd+Adam)", train, train_flops), ("eval forward", evals, eval_flops)):
        rows.append({
            "device": device.type, "what": label, "ours_ms": times["ours"] * 1e3, "theirs_ms": times["theirs"] * 1e3,
            "ratio": times["ratio"], "ratio_min": times["ratio_min"], "ratio_max": times["ratio_max"],
            "gflop": work / 1e9, "ours_gflops": work / times["ours"] / 1e9,
            "theirs_gflops": work / times["theirs"] / 1e9,
            "matmul_gflops": matmul_gflops, "tokens_per_s": batch * length / times["ours"],
        })  # fmt: skip
    return rows


def paired_ratios(ours, theirs, device: torch.device, repeats: int) -> dict[str, float]:
    """Time ``ours`` and ``theirs`` in rounds of A B B A; medians of each and of the per-round ratio."""
    for fn in (ours, theirs):
        fn()
    ratios, times = [], {"ours": [], "theirs": []}
    for _ in range(repeats):
        spent = {"ours": 0.0, "theirs": 0.0}
        for name, fn in (("ours", ours), ("theirs", theirs), ("theirs", theirs), ("ours", ours)):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            spent[name] += (time.perf_counter() - start) / 2
        ratios.append(spent["ours"] / spent["theirs"])
        for name in spent:
            times[name].append(spent[name])
    return {"ours": statistics.median(times["ours"]), "theirs": statistics.median(times["theirs"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="ModelConfig.small and a short batch, for a quick check")
    parser.add_argument("--vocab", type=int, default=1000, help="vocabulary size (shared, tied)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="rounds of A B B A")
    args = parser.parse_args()
    config = tb.ModelConfig.small(args.vocab) if args.small else tb.ModelConfig.base(args.vocab)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [row for device in devices for row in run(device, config, args.batch, args.length, args.repeats)]
    size = "small" if args.small else "base"
    title = (f"transformer_book vs nn.Transformer — {size} sizes, vocabulary {args.vocab}, "
             f"batch {args.batch} x {args.length} tokens, float32, {args.repeats} rounds of A B B A")  # fmt: skip
    print_table(
        f"{title}\n{machine()}",
        ["what", "ours ms", "nn.Transformer ms", "ratio (median, min-max)", "GFLOP", "ours GFLOP/s", "theirs GFLOP/s",
         "matmul GFLOP/s", "ours / matmul"],
        [[f"{r['device']}: {r['what']}", f"{r['ours_ms']:.1f}", f"{r['theirs_ms']:.1f}",
          f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})", f"{r['gflop']:.1f}",
          f"{r['ours_gflops']:.1f}",
          f"{r['theirs_gflops']:.1f}", f"{r['matmul_gflops']:.1f}", f"{r['ours_gflops'] / r['matmul_gflops']:.0%}"]
         for r in rows],
    )  # fmt: skip
    if not args.small:
        write_results("model", {"title": title, "config": dataclasses.asdict(config), "rows": rows})


if __name__ == "__main__":
    main()
