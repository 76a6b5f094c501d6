"""Greedy decoding with and without the KV cache: same tokens, different cost.

Without the cache every step runs the decoder over the whole prefix again
(work grows with the square of the output length); with it each step feeds only
the newest token. The model is untrained, so EOS is made impossible (its logit
bias set to -1e4) to decode exactly the requested number of tokens.

    python benchmarks/bench_decoding.py               # paper base, batch 8, 64 new tokens
    python benchmarks/bench_decoding.py --small
"""

from __future__ import annotations

import argparse

import torch

import transformer_book as tb
from common import interleaved_medians, machine, print_table

BOS, EOS = 1, 2


def run(device: torch.device, config: tb.ModelConfig, batch: int, src_len: int, new_tokens: list[int], repeats: int):
    tb.seed_everything(0)
    model = tb.make_model(config).to(device).eval()
    with torch.no_grad():
        model.generator.bias[EOS] = -1e4
    src = torch.randint(3, config.src_vocab_size, (batch, src_len), device=device)
    rows = []
    for new in new_tokens:
        def decode(use_cache):
            return lambda: tb.greedy_decode(model, src, new + 1, BOS, EOS, use_cache=use_cache)

        cached, recomputed = decode(True)(), decode(False)()
        assert cached.shape == (batch, new + 1) and torch.equal(cached, recomputed), "the cache changed the output"
        times = interleaved_medians({"cache": decode(True), "no cache": decode(False)}, device, repeats, warmup=1)
        rows.append([
            device.type, new,
            f"{times['no cache'] * 1e3:.1f}",
            f"{times['cache'] * 1e3:.1f}",
            f"{times['no cache'] / times['cache']:.2f}x",
            "yes",
        ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="ModelConfig.small, for a quick check")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = tb.ModelConfig.small(1000) if args.small else tb.ModelConfig.base()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [r for d in devices for r in run(d, config, args.batch, args.src_len, args.new_tokens, args.repeats)]
    print_table(
        f"Greedy decoding, KV cache vs recomputing the prefix — {'small' if args.small else 'paper base'} config, "
        f"batch {args.batch}, source {args.src_len} tokens, median of {args.repeats}\n{machine()}",
        ["device", "new tokens", "no cache ms", "KV cache ms", "speed-up", "identical tokens"],
        rows,
    )


if __name__ == "__main__":
    main()
