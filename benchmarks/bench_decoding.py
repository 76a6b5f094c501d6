"""Greedy decoding with and without the KV cache, and beam search: same tokens, different cost.

Two copies of one model, with the same weights: the plain model the chapters teach, and the
same model after ``transformer_book.fast.accelerate(model)`` (appendix C's speed wing: its
products on packed weights and the few-row kernel, its cached steps run by a decoding plan).
Both must give the same tokens, with and without the cache, which the script asserts before
it times anything.

Without the cache every step runs the decoder over the whole prefix again
(work grows with the square of the output length); with it each step feeds only
the newest token. The model is untrained, so EOS is made impossible (its logit
bias set to -1e4) to decode exactly the requested number of tokens. Beam search
(which always uses the cache) is timed per decoding step for a few beam sizes, for both
copies; with beam size 1 it must give greedy decoding's tokens.

Why the speed-up stops growing: a cached step computes little (a few rows per matrix)
but still runs every decoder matrix product, and products of a few rows use a CPU far
less well than the many-row products of a full prefix. And both ways encode the source
once, which the cache cannot shorten. So each row also reports the least a cached loop
can cost here ("floor ms"): the encoder alone ("encode ms"), the cross-attention keys and
values of the encoder's output (once per source), then, for every new token, a cached
step's matrix products alone with the same weights and rows, on the wing's kernels; and the
speed-up the cache would show if it cost only that ("speed-up bound"). A cached loop that runs
these products cannot beat it on this machine at this batch size and precision. After
its first step the accelerated model's cached loop runs its decoding plan
(``fast.modules.DecodingPlan``); "module path ms" is the same loop with every step through
the modules' ``forward`` (a forward hook on the decoder sends it there), which computes the
same numbers with more Python around them. Every contender is timed in turn with the others,
so the machine's drift hits all alike.

Keys of the results: ``cache_ms``, ``no_cache_ms``, ``speedup``, ``module_path_ms``,
``encode_ms``, ``cache_floor_ms`` and ``speedup_bound`` are the accelerated model's;
``plain_cache_ms``, ``plain_no_cache_ms`` and ``plain_speedup`` the plain model's;
``accelerate_speedup`` is plain over accelerated, both with the cache.

    python benchmarks/bench_decoding.py               # base sizes, vocabulary 1,000, batch 8, source 32
    python benchmarks/bench_decoding.py --small
    python benchmarks/bench_decoding.py --d-model 256 --layers 4 --d-ff 1024   # other sizes: printed only

Only the default run (no options) writes the results file that appendix C shows.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable

import torch
from common import interleaved_medians, machine, print_table, write_results

import transformer_book as tb
from transformer_book import fast
from transformer_book.fast import kernels

BOS, EOS = 1, 2


def step_products(model: tb.Transformer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (weight, bias) of every matrix product one cached decoding step runs, in its order:
    per decoder layer the packed q/k/v projection, the self-attention output, the
    cross-attention query and output (its keys and values come from the cache), the two
    feed-forward matrices; then the output layer."""
    products = []
    for layer in model.decoder.layers:
        own, cross, ff = layer.self_attn, layer.cross_attn, layer.feed_forward
        qkv = (own.q_proj, own.k_proj, own.v_proj)
        products.append((torch.cat([p.weight for p in qkv]), torch.cat([p.bias for p in qkv])))
        products += [(m.weight, m.bias) for m in (own.out_proj, cross.q_proj, cross.out_proj, ff.linear1, ff.linear2)]
    products.append((model.generator.weight, model.generator.bias))
    return [(w.detach(), b.detach()) for w, b in products]


def cross_products(model: tb.Transformer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (weight, bias) of the products a cached loop runs once per source: per decoder
    layer the packed key/value projection of the encoder's output for cross-attention."""
    kv = [(layer.cross_attn.k_proj, layer.cross_attn.v_proj) for layer in model.decoder.layers]
    return [(torch.cat([k.weight, v.weight]).detach(), torch.cat([k.bias, v.bias]).detach()) for k, v in kv]


def products_alone(
    products: list[tuple[torch.Tensor, torch.Tensor]], num_rows: int, device: torch.device
) -> Callable[[], object]:
    """The matrix products ``products`` alone, on ``num_rows`` rows each, nothing else, on the
    kernels the accelerated model's decoding uses (in inference mode on a CPU:
    ``fast.few_rows`` for a few rows, oneDNN with packed weights for more, MKL for a product
    under ``fast.kernels.PACKED_MIN_MACS``).

    The base model's weights do not fit in a CPU's caches, so here, as in decoding, every
    product reads its weights from memory."""
    products = [(w, b, kernels.PackedWeight()) for w, b in products]
    rows = {w.shape[1]: torch.randn(num_rows, w.shape[1], device=device) for w, _, _ in products}

    @torch.inference_mode()
    def run() -> list[torch.Tensor]:
        return [packed.apply(rows[w.shape[1]], w, b) for w, b, packed in products]

    return run


def models(device: torch.device, config: tb.ModelConfig) -> dict[str, tb.Transformer]:
    """The plain model and an accelerated copy with the same weights, EOS made impossible."""
    tb.seed_everything(0)
    plain = tb.make_model(config).to(device).eval()
    with torch.no_grad():
        plain.generator.bias[EOS] = -1e4
    return {"plain": plain, "accelerated": fast.accelerate(copy.deepcopy(plain))}


def run(device: torch.device, config: tb.ModelConfig, batch: int, src_len: int, new_tokens: list[int], repeats: int):
    both = models(device, config)
    model, plain = both["accelerated"], both["plain"]
    src = torch.randint(3, config.src_vocab_size, (batch, src_len), device=device)
    encode = torch.inference_mode()(lambda: model.encode(src))  # both ways do it once, first
    cross = products_alone(cross_products(model), batch * src_len, device)
    step = products_alone(step_products(model), batch, device)
    rows = []
    for new in new_tokens:

        def decode(use_cache, new=new, model=model):
            return lambda: tb.greedy_decode(model, src, new + 1, BOS, EOS, use_cache=use_cache)

        def floor(new=new) -> None:
            """The least a cached loop can cost in PyTorch: the encoder, the cross-attention
            keys and values, then each step's matrix products with nothing around them."""
            encode()
            cross()
            for _ in range(new):
                step()

        def module_path(new=new):
            """The accelerated model's cached loop with every step through the modules' forward (no
            decoding plan): a forward hook on the decoder, which does nothing, is what sends it there."""
            handle = model.decoder.register_forward_hook(lambda *_: None)
            try:
                return decode(True)()
            finally:
                handle.remove()

        cached, recomputed = decode(True)(), decode(False)()
        assert cached.shape == (batch, new + 1) and torch.equal(cached, recomputed), "the cache changed the output"
        assert torch.equal(module_path(), cached), "the decoding plan changed the output"
        plain_cached, plain_recomputed = decode(True, model=plain)(), decode(False, model=plain)()
        assert torch.equal(plain_cached, plain_recomputed), "the cache changed the plain model's output"
        assert torch.equal(plain_cached, cached), "fast.accelerate changed the output"
        # All in turn, so the machine's drift cannot favour one of them.
        fns = {"cache": decode(True), "no cache": decode(False), "plain cache": decode(True, model=plain),
               "plain no cache": decode(False, model=plain), "encode": encode, "floor": floor,
               "modules": module_path}  # fmt: skip
        times = interleaved_medians(fns, device, repeats, warmup=1)
        rows.append(
            {
                "device": device.type,
                "new_tokens": new,
                "no_cache_ms": times["no cache"] * 1e3,
                "cache_ms": times["cache"] * 1e3,
                "speedup": times["no cache"] / times["cache"],
                "plain_no_cache_ms": times["plain no cache"] * 1e3,
                "plain_cache_ms": times["plain cache"] * 1e3,
                "plain_speedup": times["plain no cache"] / times["plain cache"],
                # What fast.accelerate buys a cached loop: the plain model's time over the accelerated one's.
                "accelerate_speedup": times["plain cache"] / times["cache"],
                # The same cached loop with every step through the modules' forward, not the decoding plan.
                "module_path_ms": times["modules"] * 1e3,
                "identical": True,
                "encode_ms": times["encode"] * 1e3,
                # If a cached loop cost only the encoder, the cross-attention keys and values and
                # each step's matrix products: the most the cache could give here.
                "cache_floor_ms": times["floor"] * 1e3,
                "speedup_bound": times["no cache"] / times["floor"],
            }
        )
    return rows


def run_beam(
    device: torch.device, config: tb.ModelConfig, batch: int, src_len: int, new: int, beams: list[int], repeats: int
) -> list[dict]:
    """Beam search for ``new`` tokens: milliseconds per decoding step for each beam size, the
    accelerated model (``ms``) and the plain one (``plain_ms``)."""
    both = models(device, config)
    src = torch.randint(3, config.src_vocab_size, (batch, src_len), device=device)
    fns = {}
    for name, model in both.items():
        greedy = tb.greedy_decode(model, src, new + 1, BOS, EOS)
        assert torch.equal(tb.beam_search(model, src, new + 1, BOS, EOS, beam_size=1), greedy), "beam 1 is not greedy"
        for k in beams:
            fns[name, k] = lambda k=k, model=model: tb.beam_search(model, src, new + 1, BOS, EOS, beam_size=k)
    for k in beams:
        assert torch.equal(fns["plain", k](), fns["accelerated", k]()), "fast.accelerate changed beam search's output"
    times = interleaved_medians(fns, device, repeats, warmup=1)
    return [
        {
            "device": device.type,
            "beam_size": k,
            "new_tokens": new,
            "ms": times["accelerated", k] * 1e3,
            "ms_per_step": times["accelerated", k] * 1e3 / new,
            "plain_ms": times["plain", k] * 1e3,
            "plain_ms_per_step": times["plain", k] * 1e3 / new,
        }
        for k in beams
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="ModelConfig.small, for a quick check")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    sizes = {"d_model": "--d-model", "num_layers": "--layers", "d_ff": "--d-ff", "num_heads": "--heads"}
    for field, flag in sizes.items():
        parser.add_argument(flag, dest=field, type=int, help=f"{field}, instead of the preset's")
    args = parser.parse_args()
    overrides = {field: getattr(args, field) for field in sizes if getattr(args, field) is not None}
    preset = tb.ModelConfig.small(args.vocab) if args.small else tb.ModelConfig.base(args.vocab)
    config = dataclasses.replace(preset, **overrides)  # ModelConfig checks the sizes
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    rows = [r for d in devices for r in run(d, config, args.batch, args.src_len, args.new_tokens, args.repeats)]
    beams = [r for d in devices for r in run_beam(d, config, args.batch, args.src_len, max(args.new_tokens), args.beams,
                                                  args.repeats)]  # fmt: skip
    sizes_text = ("small" if args.small else "base") + " sizes" + "".join(f", {k} {v}" for k, v in overrides.items())
    title = (f"{sizes_text}, vocabulary {args.vocab}, batch {args.batch}, "
             f"source {args.src_len} tokens, median of {args.repeats}")  # fmt: skip
    print_table(
        f"Greedy decoding, KV cache vs recomputing the prefix, plain and accelerated — {title}\n{machine()}",
        ["device", "new tokens", "plain: no cache ms", "plain: KV cache ms", "plain: speed-up",
         "accelerated: no cache ms", "accelerated: KV cache ms", "accelerated: speed-up", "accelerate's gain (cached)",
         "identical tokens", "module path ms", "encode ms", "floor ms", "speed-up bound"],
        [[r["device"], r["new_tokens"], f"{r['plain_no_cache_ms']:.1f}", f"{r['plain_cache_ms']:.1f}",
          f"{r['plain_speedup']:.2f}x", f"{r['no_cache_ms']:.1f}", f"{r['cache_ms']:.1f}", f"{r['speedup']:.2f}x",
          f"{r['accelerate_speedup']:.2f}x", "yes", f"{r['module_path_ms']:.1f}", f"{r['encode_ms']:.1f}",
          f"{r['cache_floor_ms']:.1f}", f"{r['speedup_bound']:.2f}x"] for r in rows],
    )  # fmt: skip
    print_table(
        f"Beam search (KV cache), {max(args.new_tokens)} new tokens — {title}",
        ["device", "beam size", "plain ms", "plain ms per step", "accelerated ms", "accelerated ms per step"],
        [[r["device"], r["beam_size"], f"{r['plain_ms']:.1f}", f"{r['plain_ms_per_step']:.2f}", f"{r['ms']:.1f}",
          f"{r['ms_per_step']:.2f}"] for r in beams],
    )  # fmt: skip
    if vars(args) == vars(parser.parse_args([])):  # appendix C reads rows of the default run (16 tokens, ...)
        write_results("decoding", {"title": title, "config": dataclasses.asdict(config), "wing": fast.status(),
                                   "greedy": rows, "beam": beams})  # fmt: skip


if __name__ == "__main__":
    main()
