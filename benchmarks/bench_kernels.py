"""The speed wing's CPU kernels against PyTorch's own, claim by claim (appendix C's kernel table).

``transformer_book.fast`` (what ``fast.accelerate(model)`` runs the model on) sends float32
products on a CPU to oneDNN instead of MKL (``fast.kernels.affine``, ``FastLinear``), sends the
few-row products and the attention of decoding to kernels of its own (``fast.few_rows``), keeps
products under ``fast.kernels.PACKED_MIN_MACS`` multiply-adds with MKL, and computes dropout in
one pass (``fast.dropout_kernel``, ``FastDropout``). Each row below times one of those choices
against PyTorch's default, the two taking turns, so that appendix C can state the figures from
this script's results file instead of typing them:

- training products: the base model's matrix products on 8 × 64 rows, MKL (``F.linear``)
  against oneDNN with the weight as it is (as the forward of a training step runs them);
- decoding products: the same weights on 8 rows (one new token per sentence), MKL against
  the few-row kernel; beside them, oneDNN with packed weights (the wing's kernel for
  them before the few-row one) and reading every weight once with nothing else
  (``weight.sum()``), the least time a product that must read its weight can take;
- decoding attention: a step's attentions of one new position (every layer's, over 64 cached
  positions and over 32 source positions), PyTorch's fused kernel against
  ``few_rows.attention``;
- how many rows are few: the few-row kernel against packed oneDNN on the same weights, from
  1 to 32 rows (``few_rows.MAX_ROWS`` is where it stops winning);
- one call: the cost of a product too small to measure anything but the call, 8 × 64 × 64;
- a small model's decoding step: the accelerated small model's greedy decoding with the size
  rule (``PACKED_MIN_MACS``) against every product packed, in µs per new token (the encoder's
  share included);
- dropout masks: ``F.dropout`` against ``FastDropout`` on a feed-forward layer's hidden
  activations in training;
- the feed-forward layer's ReLU and dropout, forward and backward: ReLU and then
  ``FastDropout`` (two passes each way) against one pass each way (``kernels.relu_dropout``),
  which is what the fusion alone saves.

    python benchmarks/bench_kernels.py               # base sizes, vocabulary 1,000
    python benchmarks/bench_kernels.py --repeats 3   # quicker (prints only)

Only the default run writes the results file that appendix C shows.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from unittest.mock import patch

import torch
import torch.nn.functional as F
from bench_decoding import products_alone, step_products
from common import interleaved_medians, machine, print_table, write_results

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import few_rows, kernels
from transformer_book.fast.kernels import FastDropout

CPU = torch.device("cpu")


def products(weights: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, kernel: str) -> Callable[[], object]:
    """Every product of ``weights`` on ``num_rows`` random rows with one ``kernel``: ``"mkl"``
    (``F.linear``), ``"onednn"`` (the weight as it is), ``"packed"`` (oneDNN, packed weight)
    or ``"few rows"`` (``fast.few_rows``, whatever the number of rows)."""
    if kernel in ("packed", "few rows"):
        run = products_alone(weights, num_rows, CPU)

        def limited() -> object:
            # the packed oneDNN path: no product is few enough; the few-row kernel: every one is
            with patch.object(few_rows, "MAX_ROWS", 0 if kernel == "packed" else num_rows):
                return run()

        return limited
    rows = {w.shape[1]: torch.randn(num_rows, w.shape[1]) for w, _ in weights}
    product = F.linear if kernel == "mkl" else kernels.affine  # oneDNN in inference mode

    @torch.inference_mode()
    def run() -> list[torch.Tensor]:
        return [product(rows[w.shape[1]], w, b) for w, b in weights]

    return run


def read_once(weights: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
    """Read every weight once and do next to nothing with it: a sum per weight."""
    return lambda: [w.sum() for w, _ in weights]


def row(what: str, pytorch: str, package: str, times: dict[str, float], per: int = 1, **extra) -> dict:
    """One line of the table: both times in µs per ``per`` (calls or steps), and their ratio."""
    return {
        "what": what,
        "pytorch": pytorch,
        "package": package,
        "pytorch_us": times[pytorch] * 1e6 / per,
        "package_us": times[package] * 1e6 / per,
        "speedup": times[pytorch] / times[package],
        **extra,
    }


def run(vocab: int, repeats: int) -> list[dict]:
    tb.seed_everything(0)
    base = tb.make_model(tb.ModelConfig.base(vocab)).eval()
    weights = step_products(base)  # every product of a decoder step, the output layer's too
    megabytes = sum(w.numel() * w.element_size() for w, _ in weights) / 1e6
    rows = []

    times = interleaved_medians({"MKL": products(weights, 8 * 64, "mkl"),
                                 "oneDNN": products(weights, 8 * 64, "onednn")}, CPU, repeats)  # fmt: skip
    rows.append(row("training products (8 × 64 rows, base sizes)", "MKL", "oneDNN", times, len(weights)))

    assert few_rows.available(), few_rows.unavailable_reason()
    times = interleaved_medians({"MKL": products(weights, 8, "mkl"), "few-row kernel": products(weights, 8, "few rows"),
                                 "packed oneDNN": products(weights, 8, "packed"), "read once": read_once(weights)},
                                CPU, repeats)  # fmt: skip
    gb_per_s = {name: megabytes / 1e3 / seconds for name, seconds in times.items()}
    rows.append(row("decoding products (8 rows, base sizes)", "MKL", "few-row kernel", times, len(weights),
                    weights_mb=megabytes, read_once_us=times["read once"] * 1e6 / len(weights),
                    onednn_us=times["packed oneDNN"] * 1e6 / len(weights), pytorch_gb_per_s=gb_per_s["MKL"],
                    package_gb_per_s=gb_per_s["few-row kernel"], onednn_gb_per_s=gb_per_s["packed oneDNN"],
                    read_once_gb_per_s=gb_per_s["read once"]))  # fmt: skip

    # A step's attention at base sizes: in each layer the new position against 64 cached positions
    # (self-attention) and 32 source positions (cross), each with keys and values of its own.
    config = base.config

    def heads(length: int) -> torch.Tensor:  # (batch 8, heads, length, d_head)
        return torch.randn(8, config.num_heads, length, config.d_head)

    keys_values = [(heads(n), heads(n)) for _ in range(config.num_layers) for n in (64, 32)]
    query = heads(1)

    def step_attention(attend: Callable[..., torch.Tensor]) -> Callable[[], object]:
        return torch.inference_mode()(lambda: [attend(query, k, v) for k, v in keys_values])

    def fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # heads merged, as the kernel's
        return F.scaled_dot_product_attention(q, k, v).reshape(q.shape[0], 1, -1)

    times = interleaved_medians({"fused SDPA": step_attention(fused_sdpa),
                                 "few-row attention": step_attention(few_rows.attention)}, CPU, repeats)  # fmt: skip
    rows.append(row("decoding step's attention (64 cached, 32 source, base sizes)", "fused SDPA", "few-row attention",
                    times))  # fmt: skip

    tiny = [(torch.randn(64, 64), torch.randn(64))] * 200
    times = interleaved_medians({"MKL": products(tiny, 8, "mkl"), "oneDNN": products(tiny, 8, "onednn")}, CPU, repeats)
    rows.append(row("one call (8 × 64 × 64, nothing to compute)", "MKL", "oneDNN", times, len(tiny)))

    small = fast.accelerate(tb.make_model(tb.ModelConfig.small(vocab)).eval())
    src = torch.randint(3, vocab, (8, 16))
    new = 32

    def decode(model: tb.Transformer, min_macs: int) -> Callable[[], object]:
        def go() -> object:
            with patch.object(kernels, "PACKED_MIN_MACS", min_macs):
                return tb.greedy_decode(model, src, new + 1, 1, None)

        return go

    times = interleaved_medians({"every product packed": decode(small, 0),
                                 "size rule": decode(small, kernels.PACKED_MIN_MACS)}, CPU, repeats)  # fmt: skip
    rows.append(row("small model, greedy decoding step (batch 8)", "every product packed", "size rule", times, new))

    hidden = torch.randn(8, 64, 2048, requires_grad=True)  # a feed-forward layer's, in training
    ours = FastDropout(0.1)
    times = interleaved_medians({"F.dropout": lambda: F.dropout(hidden, 0.1), "FastDropout": lambda: ours(hidden)},
                                CPU, repeats)  # fmt: skip
    rows.append(row("dropout, training (8 × 64 × 2048)", "F.dropout", "FastDropout", times))

    pre = torch.randn(8, 64, 2048, requires_grad=True)  # linear1's output: ReLU, dropout, and back
    grad = torch.randn(8, 64, 2048)

    def two_steps() -> object:  # FastDropout after ReLU: the row measures the fusion alone
        return torch.autograd.grad(ours(pre.relu()), pre, grad)

    def one_pass() -> object:
        return torch.autograd.grad(kernels.relu_dropout(pre, ours), pre, grad)

    times = interleaved_medians({"ReLU, then FastDropout": two_steps, "relu_dropout": one_pass}, CPU, repeats)
    rows.append(row("ReLU and dropout, forward + backward (8 × 64 × 2048)", "ReLU, then FastDropout", "relu_dropout",
                    times))  # fmt: skip
    return rows


def run_few_rows(vocab: int, repeats: int, counts: tuple[int, ...] = (1, 4, 8, 16, 32)) -> list[dict]:
    """The few-row kernel against packed oneDNN on a decoding step's weights (base sizes), by rows."""
    tb.seed_everything(0)
    weights = step_products(tb.make_model(tb.ModelConfig.base(vocab)).eval())
    megabytes = sum(w.numel() * w.element_size() for w, _ in weights) / 1e6
    result = []
    for count in counts:
        times = interleaved_medians({"packed oneDNN": products(weights, count, "packed"),
                                     "few-row kernel": products(weights, count, "few rows")}, CPU, repeats)  # fmt: skip
        result.append({"rows": count, "onednn_us": times["packed oneDNN"] * 1e6 / len(weights),
                       "few_rows_us": times["few-row kernel"] * 1e6 / len(weights),
                       "speedup": times["packed oneDNN"] / times["few-row kernel"],
                       "few_rows_gb_per_s": megabytes / 1e3 / times["few-row kernel"]})  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    rows = run(args.vocab, args.repeats)
    few = run_few_rows(args.vocab, args.repeats)
    title = f"vocabulary {args.vocab}, float32, median of {args.repeats}, µs per call (per step for decoding)"
    print_table(
        f"The speed wing's CPU kernels (transformer_book.fast) against PyTorch's — {title}\n{machine()}",
        ["what", "PyTorch's", "µs", "the wing's", "µs", "speed-up"],
        [[r["what"], r["pytorch"], f"{r['pytorch_us']:.1f}", r["package"], f"{r['package_us']:.1f}",
          f"{r['speedup']:.2f}x"] for r in rows],
    )  # fmt: skip
    decoding = rows[1]
    print(f"\nDecoding products read {decoding['weights_mb']:.0f} MB of weights per step: MKL at "
          f"{decoding['pytorch_gb_per_s']:.1f} GB/s, packed oneDNN at {decoding['onednn_gb_per_s']:.1f} GB/s, "
          f"the few-row kernel at {decoding['package_gb_per_s']:.1f} GB/s; a sum over each weight reads them at "
          f"{decoding['read_once_gb_per_s']:.1f} GB/s.\n")  # fmt: skip
    print_table(
        f"The few-row kernel against packed oneDNN, a decoding step's products (base sizes), µs per product; "
        f"the wing uses it up to {few_rows.MAX_ROWS} rows",
        ["rows", "packed oneDNN µs", "few-row kernel µs", "speed-up", "few-row GB/s"],
        [[r["rows"], f"{r['onednn_us']:.1f}", f"{r['few_rows_us']:.1f}", f"{r['speedup']:.2f}x",
          f"{r['few_rows_gb_per_s']:.1f}"] for r in few],
    )  # fmt: skip
    if vars(args) == vars(parser.parse_args([])):
        write_results("kernels", {"title": title, "rows": rows, "few_rows": few, "few_rows_max": few_rows.MAX_ROWS,
                                  "wing": fast.status()})  # fmt: skip


if __name__ == "__main__":
    main()
