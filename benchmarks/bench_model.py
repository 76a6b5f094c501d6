"""One training step and one eval forward: this package against PyTorch's nn.Transformer.

Both models compute the same function: the nn.Transformer gets PyTorch's own
encoder and decoder layers holding a copy of our weights, and shares our
embeddings, positional encoding and output layer. The achieved GFLOP/s is
printed next to a plain matmul's, measured in the same run.

    python benchmarks/bench_model.py                # paper base, batch 8 x 64 tokens
    python benchmarks/bench_model.py --small        # a quick run
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from common import interleaved_medians, machine, print_table
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


def run(device: torch.device, config: tb.ModelConfig, batch: int, length: int, repeats: int) -> list[list[str]]:
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
    optimisers = {name: torch.optim.Adam(model.parameters(), lr=1e-4) for name, model in (("ours", ours), ("theirs", theirs))}

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
        torch.testing.assert_close(ours(src, tgt_in, src_mask, tgt_mask), theirs(src, tgt_in, src_mask, tgt_mask), atol=1e-4, rtol=1e-4)

    train_flops = flops(train_step("ours", ours))
    eval_flops = flops(eval_forward(ours))
    train = interleaved_medians({"ours": train_step("ours", ours), "theirs": train_step("theirs", theirs)}, device, repeats)
    evals = interleaved_medians({"ours": eval_forward(ours), "theirs": eval_forward(theirs)}, device, repeats)

    n = 2048 if device.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    matmul = interleaved_medians({"mm": lambda: a @ b}, device, repeats)["mm"]
    matmul_gflops = 2 * n**3 / matmul / 1e9

    rows = []
    for label, times, work in (("train step (fwd+bwd+Adam)", train, train_flops), ("eval forward", evals, eval_flops)):
        rows.append([
            f"{device.type}: {label}",
            f"{times['ours'] * 1e3:.1f}",
            f"{times['theirs'] * 1e3:.1f}",
            f"{times['ours'] / times['theirs']:.3f}",
            f"{work / 1e9:.1f}",
            f"{work / times['ours'] / 1e9:.1f}",
            f"{work / times['theirs'] / 1e9:.1f}",
            f"{matmul_gflops:.1f}",
        ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="ModelConfig.small and a short batch, for a quick check")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    config = tb.ModelConfig.small(1000) if args.small else tb.ModelConfig.base()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [row for device in devices for row in run(device, config, args.batch, args.length, args.repeats)]
    print_table(
        f"transformer_book vs nn.Transformer — {'small' if args.small else 'paper base'} config, "
        f"batch {args.batch} x {args.length} tokens, float32, median of {args.repeats} (interleaved)\n{machine()}",
        ["what", "ours ms", "nn.Transformer ms", "ratio (ours/theirs)", "GFLOP", "ours GFLOP/s", "theirs GFLOP/s", "matmul GFLOP/s"],
        rows,
    )


if __name__ == "__main__":
    main()
