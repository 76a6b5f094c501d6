"""Greedy decoding with the static KV cache and by recomputing the prefix, and beam search.

The model the chapters teach decodes the same source four ways, which must give the same
tokens (asserted before anything is timed):

- ``cache``: ``tb.greedy_decode(..., use_cache=True)``: each step feeds only the newest token
  and reads the keys and values of the earlier ones from the static cache;
- ``no cache``: ``tb.greedy_decode(..., use_cache=False)``: each step runs the decoder over the
  whole prefix again, so the work grows with the square of the output length;
- ``compiled``: the cached step compiled whole (``tb.compile_model``, ``fullgraph=True``; on a
  GPU ``mode="reduce-overhead"``, which replays the step as a CUDA graph; on a CPU with two of
  Inductor's options, :func:`compile_options` says which and why), driven by the loop below under
  ``tb.trusted_ids()``. Its cache lives in the buffers of a module (:class:`StaticStep`),
  because torch.compile takes a module's tensors to stay where they are, as its parameters do,
  and a CUDA graph may write in place only into memory that stays put. Its first call, the
  compilation, is timed on its own (``compile_s``);
- ``compiled no cache``: the recomputing step compiled (:class:`RecomputeStep`), with
  ``dynamic=True``, since its prefix grows by a token each step: one graph for every length
  (on a CPU with the same options; on a GPU without CUDA graphs, which would record one
  graph per length). Against ``compiled``, it measures what the cache buys a compiled decoder.

The model is untrained, so EOS is made impossible (its logit bias set to -1e4) and every way
decodes exactly the requested number of tokens. Each row reports milliseconds per generated
token (the source's encoding included, once per call, as in use) and the speed-ups as medians
over rounds of A B C C B A of the ratio within the round, with the lowest and highest round.
Beam search (with the cache, its default) is timed per decoding step for a few beam sizes;
with beam size 1 it must give greedy decoding's tokens. And since a cached step at a small batch
is paced by memory (it reads every weight of the decoder to multiply it by a row or a few), the
script reports how many megabytes of weights a step reads (``step_weights_mb``) and how fast a
plain sum reads as many bytes here (``read_gb_per_s``): their quotient is about the least a
cached step can cost on this machine.

    python benchmarks/bench_decoding.py             # base sizes, vocabulary 1,000, source 32, batch 1 and 8
    python benchmarks/bench_decoding.py --small

Only the default run writes the results file that appendix C shows: ``results/decoding.json``
on a CPU, ``results/decoding_cuda.json`` on a GPU; ``--results NAME`` writes ``results/NAME.json``
(appendix C also shows ``decoding_second_cpu.json``, the default run on another CPU). The script
also times the step's matrix products alone (``products_ms``, at the first batch size), the
same modules on inputs of the step's shapes: set beside the step's time and the plain sum's
pace, it says whether the matrix kernels or everything around them set a step's cost. On a
CPU it times them on one thread too (``products_one_thread_ms``): where the two are alike, the
library ran its matrix-vector products on one core, whatever the thread count. The options the
compiled steps were built with are in the file (``compile_options``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from common import (
    cold_compile_cache,
    interleaved_medians,
    machine,
    paired_ratios,
    print_table,
    spread,
    synchronize,
    write_results,
)
from torch import nn

import transformer_book as tb

BOS, EOS = 1, 2


def compile_options(device: torch.device, dynamic: bool) -> dict:
    """``tb.compile_model``'s options for a decoding step: on a GPU a CUDA graph where the shapes
    are fixed. On a CPU two of Inductor's options (``torch.compile``'s ``options``):

    - ``cpp_wrapper``: the step's kernels are called from C++, not from generated Python (a
      batch-1 step is hundreds of small calls: on a 2-core Xeon it took a fifth to a quarter
      off the step);
    - the ``decompose_mm_pass``: a product of one row by a matrix (no larger than 2,048 a
      side) becomes a multiplication and a sum, which Inductor's loops run on every core. On a
      2-core EPYC, MKL ran those products on one core, well below the pace at which a plain
      sum read memory; decomposed, the base model's compiled cached step at batch 1 took less
      time than the eager products alone (``results/decoding_second_cpu.json``). Larger
      batches keep the library's products, and so does a larger matrix (the paper's
      37,000-word output layer). The recomputing step's graph for every prefix length is
      symbolic in that length, so only its products of one row (the output layer's) decompose.
    """
    if device.type == "cuda":
        return {"dynamic": dynamic} | ({} if dynamic else {"mode": "reduce-overhead"})
    inductor = {"cpp_wrapper": True, "post_grad_fusion_options": {"decompose_mm_pass": {}}}
    return {"dynamic": dynamic, "options": inductor}


class StaticStep(nn.Module):
    """One greedy decoding step of ``model`` for ``batch`` sources of ``src_len`` tokens, its
    static cache held in this module's buffers: ``forward(token (batch, 1))`` → the next token
    ``(batch,)``, written into the cache at its position, which moves on, on the device.

    :meth:`start` encodes a new source into the same buffers, so one compiled step serves every
    source of that shape without compiling again."""

    def __init__(self, model: tb.Transformer, batch: int, src_len: int, capacity: int) -> None:
        super().__init__()
        self.model = model
        device = next(model.parameters()).device
        self.register_buffer("memory", torch.zeros(batch, src_len, model.config.d_model, device=device))
        self.register_buffer("src_mask", torch.ones(batch, 1, src_len, dtype=torch.bool, device=device))
        with torch.no_grad():
            cache = model.decoder.new_cache(self.memory, capacity)
        self.register_buffer("position", cache.position)
        for i, layer in enumerate(cache.layers):
            for part, kv in (("self", layer.self_attn), ("cross", layer.cross_attn)):
                self.register_buffer(f"{part}_key_{i}", kv.key.clone())
                self.register_buffer(f"{part}_value_{i}", kv.value.clone())

    def cache(self) -> tb.DecoderCache:
        """The cache, as ``model.decode`` takes it: views of the buffers, nothing copied."""
        layers = [
            tb.LayerCache(
                tb.KVCache(getattr(self, f"self_key_{i}"), getattr(self, f"self_value_{i}"), self.position),
                tb.KVCache(getattr(self, f"cross_key_{i}"), getattr(self, f"cross_value_{i}")),
            )
            for i in range(len(self.model.decoder.layers))
        ]
        return tb.DecoderCache(layers, self.position)

    def start(self, src: torch.Tensor) -> None:
        """Encode ``src``, project the cross-attention's keys and values once, empty the cache."""
        self.src_mask.copy_(tb.padding_mask(src, self.model.config.pad_id))
        self.memory.copy_(self.model.encode(src, self.src_mask))
        for layer, cached in zip(self.model.decoder.layers, self.cache().layers, strict=True):
            key, value = layer.cross_attn.keys_values(self.memory, self.memory)
            cached.cross_attn.key.copy_(key)
            cached.cross_attn.value.copy_(value)
        self.position.zero_()

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        hidden = self.model.decode(self.memory, token, src_mask=self.src_mask, cache=self.cache())
        return self.model.generator(hidden[:, -1]).argmax(-1)


def greedy_ids(model: tb.Transformer, batch: int, new: int, next_token) -> torch.Tensor:
    """ids ``(batch, new + 1)``: BOS, then ``next_token(ys, t)`` → ``(batch,)`` for each of the
    ``new`` positions ``t``, under ``tb.trusted_ids()`` (the ids are the model's own: never read
    back for a range check). What ``tb.greedy_decode`` gives when no row ends early."""
    device = next(model.parameters()).device
    ys = torch.full((batch, new + 1), model.config.pad_id, device=device)
    ys[:, 0] = BOS
    with tb.trusted_ids():
        for t in range(1, new + 1):
            ys[:, t] = next_token(ys, t)
    return ys


def compiled_decoder(model: tb.Transformer, batch: int, src_len: int, new: int):
    """A greedy decoder for ``new`` tokens on a compiled :class:`StaticStep`: ``decode(src)`` →
    ids ``(batch, new + 1)``."""
    device = next(model.parameters()).device
    step = StaticStep(model, batch, src_len, new)
    # dynamic=False: each capacity and batch gets kernels of its own, never a shape-generic one.
    compiled = tb.compile_model(step, device, **compile_options(device, dynamic=False))

    def next_token(ys: torch.Tensor, t: int) -> torch.Tensor:
        if device.type == "cuda":  # a new replay of the CUDA graph; the last one's output is in ys
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(ys[:, t - 1 : t])

    @torch.inference_mode()
    def decode(src: torch.Tensor) -> torch.Tensor:
        with tb.trusted_ids():
            step.start(src)
        return greedy_ids(model, batch, new, next_token)

    return decode


class RecomputeStep(nn.Module):
    """One greedy decoding step without a cache: ``forward(memory, src_mask, prefix (batch, t))``
    → the next token ``(batch,)``, the decoder run over the whole prefix again."""

    def __init__(self, model: tb.Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, memory: torch.Tensor, src_mask: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        hidden = self.model.decode(memory, prefix, src_mask=src_mask)
        return self.model.generator(hidden[:, -1]).argmax(-1)


def compiled_recomputer(model: tb.Transformer):
    """A greedy decoder without a cache on a compiled :class:`RecomputeStep`, one graph for every
    prefix length (``dynamic=True``): ``decode(src, new)`` → ids ``(batch, new + 1)``."""
    device = next(model.parameters()).device
    compiled = tb.compile_model(RecomputeStep(model), device, **compile_options(device, dynamic=True))

    @torch.inference_mode()
    def decode(src: torch.Tensor, new: int) -> torch.Tensor:
        src_mask = tb.padding_mask(src, model.config.pad_id)
        with tb.trusted_ids():
            memory = model.encode(src, src_mask)
        return greedy_ids(model, src.shape[0], new, lambda ys, t: compiled(memory, src_mask, ys[:, :t]))

    return decode


def step_weights_mb(config: tb.ModelConfig) -> float:
    """Megabytes of float32 weights one cached greedy step reads: per decoder layer the
    self-attention's four projections, the cross-attention's query and output projections (its
    keys and values are projected once per source) and the feed-forward network; then the output
    layer."""
    d = config.d_model
    per_layer = 6 * d * d + 2 * d * config.d_ff
    return 4 * (config.num_layers * per_layer + d * config.tgt_vocab_size) / 1e6


def step_linears(model: tb.Transformer) -> list[nn.Linear]:
    """The matrix products of one cached greedy step, in order: :func:`step_weights_mb`'s
    weights, as the modules that hold them."""
    linears = []
    for layer in model.decoder.layers:
        attend, cross, ffn = layer.self_attn, layer.cross_attn, layer.feed_forward
        linears += [attend.q_proj, attend.k_proj, attend.v_proj, attend.out_proj]
        linears += [cross.q_proj, cross.out_proj, ffn.linear1, ffn.linear2]
    return [*linears, model.generator]


def products_ms(linears: list[nn.Linear], batch: int, repeats: int) -> float:
    """Milliseconds for one cached step's matrix products alone (:func:`step_linears`, each on a
    ``(batch, in_features)`` input), the fastest of ``repeats`` passes: what the step would cost if
    nothing but its products took time, on this machine's own matrix kernels."""
    device = linears[0].weight.device
    inputs = [torch.randn(batch, linear.in_features, device=device) for linear in linears]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 2):
            synchronize(device)
            start = time.perf_counter()
            for linear, x in zip(linears, inputs, strict=True):
                linear(x)
            synchronize(device)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def products_one_thread_ms(linears: list[nn.Linear], batch: int, repeats: int) -> float:
    """:func:`products_ms` with PyTorch's intra-op threads set to one (restored after): beside
    ``products_ms``, whether the library spread a step's products over the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return products_ms(linears, batch, repeats)
    finally:
        torch.set_num_threads(threads)


def read_gb_per_s(device: torch.device, megabytes: float, repeats: int) -> float:
    """GB/s of a plain sum over ``megabytes`` of float32, the fastest of ``repeats`` calls: about
    the pace at which this machine's memory delivers a step's weights to the cores."""
    x = torch.ones(int(megabytes * 1e6 / 4), device=device)
    best = float("inf")
    for _ in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return megabytes / 1e3 / best


def make_model(device: torch.device, config: tb.ModelConfig) -> tb.Transformer:
    """The plain model, in eval mode, with EOS made impossible (so every length is exact)."""
    tb.seed_everything(0)
    model = tb.make_model(config).to(device).eval()
    with torch.no_grad():
        model.generator.bias[EOS] = -1e4
    return model


def run(
    device: torch.device,
    config: tb.ModelConfig,
    batch: int,
    src_len: int,
    new_tokens: list[int],
    repeats: int,
    compiled: bool = True,
) -> list[dict]:
    """Greedy decoding, cache against recomputation (and the compiled cached step unless
    ``compiled=False``, which compiles nothing), one row per output length."""
    model = make_model(device, config)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(3, config.src_vocab_size, (batch, src_len), generator=generator).to(device)
    rows = []
    recompute = compiled_recomputer(model) if compiled else None  # one graph serves every length
    for new in new_tokens:
        fns = {
            "cache": lambda new=new: tb.greedy_decode(model, src, new + 1, BOS, EOS, use_cache=True),
            "no cache": lambda new=new: tb.greedy_decode(model, src, new + 1, BOS, EOS, use_cache=False),
        }
        cached = fns["cache"]()
        assert cached.shape == (batch, new + 1), "EOS ended a row early"
        assert torch.equal(fns["no cache"](), cached), "the cache changed the tokens"
        compile_s = None
        if compiled:
            decode = compiled_decoder(model, batch, src_len, new)
            start = time.perf_counter()
            first = decode(src)
            compile_s = time.perf_counter() - start
            assert torch.equal(first, cached), "the compiled step changed the tokens"
            fns["compiled"] = lambda decode=decode: decode(src)
            assert torch.equal(recompute(src, new), cached), "the compiled recomputation changed the tokens"
            fns["compiled no cache"] = lambda new=new: recompute(src, new)
        times = paired_ratios(fns, "cache", device, repeats)
        row = {
            "device": device.type, "batch": batch, "new_tokens": new,
            "cache_ms": times["cache"]["seconds"] * 1e3, "no_cache_ms": times["no cache"]["seconds"] * 1e3,
            "cache_ms_per_token": times["cache"]["seconds"] * 1e3 / new,
            "no_cache_ms_per_token": times["no cache"]["seconds"] * 1e3 / new,
            # recomputation / cache, within each round: what the cache buys
            "speedup": times["no cache"]["ratio"], "speedup_min": times["no cache"]["ratio_min"],
            "speedup_max": times["no cache"]["ratio_max"], "identical": True,
        }  # fmt: skip
        if compiled:
            t, t_no_cache = times["compiled"], times["compiled no cache"]
            # compiled recomputation / compiled cache, within each round: what the cache buys compiled
            ratios = [a / b for a, b in zip(t_no_cache["rounds"], t["rounds"], strict=True)]
            row |= {
                "compiled_ms": t["seconds"] * 1e3, "compiled_ms_per_token": t["seconds"] * 1e3 / new,
                # eager cache / compiled cache: what compiling the step buys
                "compile_speedup": 1 / t["ratio"], "compile_speedup_min": 1 / t["ratio_max"],
                "compile_speedup_max": 1 / t["ratio_min"], "compile_s": compile_s,
                "compiled_vs_no_cache": times["no cache"]["seconds"] / t["seconds"],
                "compiled_no_cache_ms": t_no_cache["seconds"] * 1e3,
                "compiled_no_cache_ms_per_token": t_no_cache["seconds"] * 1e3 / new,
                **spread(ratios, "compiled_speedup"),
            }  # fmt: skip
        rows.append(row)
    return rows


def run_beam(
    device: torch.device, config: tb.ModelConfig, batch: int, src_len: int, new: int, beams: list[int], repeats: int
) -> list[dict]:
    """Beam search for ``new`` tokens: milliseconds per decoding step for each beam size."""
    model = make_model(device, config)
    src = torch.randint(3, config.src_vocab_size, (batch, src_len), generator=torch.Generator().manual_seed(1))
    src = src.to(device)
    greedy = tb.greedy_decode(model, src, new + 1, BOS, EOS)
    assert torch.equal(tb.beam_search(model, src, new + 1, BOS, EOS, beam_size=1), greedy), "beam 1 is not greedy"
    fns = {k: lambda k=k: tb.beam_search(model, src, new + 1, BOS, EOS, beam_size=k) for k in beams}
    times = interleaved_medians(fns, device, repeats, warmup=1)
    return [{"device": device.type, "batch": batch, "beam_size": k, "new_tokens": new, "ms": times[k] * 1e3,
             "ms_per_step": times[k] * 1e3 / new} for k in beams]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cpu or cuda (default: cuda if there is one)")
    parser.add_argument("--small", action="store_true", help="ModelConfig.small, for a quick check")
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="one table row group per batch size")
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of A B C C B A")
    parser.add_argument("--no-compile", dest="compiled", action="store_false", help="leave out the compiled step")
    parser.add_argument("--results", help="write results/<RESULTS>.json (a default run writes decoding[_cuda].json)")
    args = parser.parse_args()
    default_run = vars(args) | {"results": None} == vars(parser.parse_args([]))
    cold_compile_cache()  # compile_s: compiling, not reading an earlier run's kernels
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = tb.ModelConfig.small(args.vocab) if args.small else tb.ModelConfig.base(args.vocab)
    rows = []
    for batch in args.batches:
        rows += run(device, config, batch, args.src_len, args.new_tokens, args.repeats, args.compiled)
    beams = run_beam(device, config, 1, args.src_len, max(args.new_tokens), args.beams, args.repeats)
    weights_mb = step_weights_mb(config)
    linears = step_linears(make_model(device, config))
    memory = {
        "step_weights_mb": weights_mb, "read_gb_per_s": read_gb_per_s(device, weights_mb, args.repeats * 4),
        "products_batch": args.batches[0], "products_count": len(linears),
        "products_ms": products_ms(linears, args.batches[0], args.repeats * 4),
    }  # fmt: skip
    if device.type == "cpu":
        memory["products_one_thread_ms"] = products_one_thread_ms(linears, args.batches[0], args.repeats * 4)
    size = "small" if args.small else "base"
    title = (f"{device.type}, {size} sizes, vocabulary {args.vocab}, float32, source {args.src_len} tokens, "
             f"{args.repeats} rounds of A B C C B A")  # fmt: skip
    compiled = ["compiled ms/token", "compiled vs eager cache", "compile s", "compiled no cache ms/token",
                "compiled cache speed-up (median, min-max)"] if args.compiled else []  # fmt: skip
    print_table(
        f"Greedy decoding, static KV cache vs recomputing the prefix — {title}\n{machine()}",
        ["batch", "new tokens", "no cache ms/token", "cache ms/token", "cache speed-up (median, min-max)", *compiled],
        [[r["batch"], r["new_tokens"], f"{r['no_cache_ms_per_token']:.2f}", f"{r['cache_ms_per_token']:.2f}",
          f"{r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f})",
          *([f"{r['compiled_ms_per_token']:.2f}", f"{r['compile_speedup']:.2f}x", f"{r['compile_s']:.1f}",
             f"{r['compiled_no_cache_ms_per_token']:.2f}",
             f"{r['compiled_speedup']:.2f}x ({r['compiled_speedup_min']:.2f}-{r['compiled_speedup_max']:.2f})"]
            if args.compiled else [])] for r in rows],
    )  # fmt: skip
    print(
        f"\na cached step reads {weights_mb:.0f} MB of weights; a plain sum over as many bytes: "
        f"{memory['read_gb_per_s']:.1f} GB/s; its {memory['products_count']} matrix products alone, at batch "
        f"{memory['products_batch']}: {memory['products_ms']:.2f} ms ({weights_mb / memory['products_ms']:.1f} GB/s)"
        + (f", on one thread {memory['products_one_thread_ms']:.2f} ms" if "products_one_thread_ms" in memory else "")
    )
    print_table(
        f"Beam search (KV cache), batch 1, {max(args.new_tokens)} new tokens — {title}",
        ["beam size", "ms", "ms per step"],
        [[r["beam_size"], f"{r['ms']:.1f}", f"{r['ms_per_step']:.2f}"] for r in beams],
    )  # fmt: skip
    if default_run or args.results:  # appendix C reads the default runs, and those it names
        name = args.results or ("decoding_cuda" if device.type == "cuda" else "decoding")
        options = {"cached": compile_options(device, dynamic=False), "recompute": compile_options(device, dynamic=True)}
        compiled_with = {"compile_options": options} if args.compiled else {}  # none compiled: no options
        write_results(name, {"title": title, "config": dataclasses.asdict(config), "src_len": args.src_len,
                             **memory, **compiled_with, "greedy": rows, "beam": beams})  # fmt: skip


if __name__ == "__main__":
    main()
