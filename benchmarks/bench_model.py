"""One training step and one eval forward: the package's model against PyTorch's nn.Transformer,
each eager and compiled.

Four contenders (five on a CPU, and one or two more with ``--loss-chunk``) compute the same function with
the same weights, in one run:

- ``plain``: the model the chapters teach, plain PyTorch (``nn.Linear``, ``nn.Dropout``,
  ``F.scaled_dot_product_attention``), run eagerly;
- ``plain_compiled``: the same model compiled whole, ``tb.compile_model(model)``, that is
  ``torch.compile(model, fullgraph=True)`` (on a CPU with Inductor's ``fallback_random``, so
  dropout draws eager's masks);
- ``theirs``: PyTorch's ``nn.Transformer``, its encoder and decoder layers holding a copy of
  our weights, between embeddings, positional encoding and an output layer that are copies of
  ours (the baseline every ratio divides by);
- ``theirs_compiled``: the same ``nn.Transformer`` under ``torch.compile``;
- ``plain_scalar_compiled`` (on a CPU): ``plain_compiled`` with Inductor's scalar C++
  (``options={"cpp.simdlen": 1}``): loops of plain floats, without ATen's vector types, which
  write bool masks as fast as eager does (``mask_stores``), with every other loop unvectorised too;
- ``plain_compiled_chunked`` (with ``--loss-chunk``, on by default on a GPU): the training
  step of ``plain_compiled`` with the loss computed in chunks of positions,
  ``tb.chunked_loss``, so that the whole batch's logits never exist at once; the encoder,
  decoder and chunked loss are compiled as one function (its eval forward is
  ``plain_compiled``'s, so it has no eval row);
- ``plain_compiled_chunked_graphs`` (with ``--loss-chunk`` on a GPU): the same step compiled
  with ``mode="reduce-overhead"``, which replays the step's kernels as CUDA graphs, so the
  host no longer launches them one by one.

A training step is the book's: forward, the label-smoothed loss (``tb.LabelSmoothingLoss``,
smoothing 0.1), backward, and the book's Adam (``tb.noam_optimizer``: PyTorch's fused Adam),
dropout 0.1, each contender with weights and optimiser state of its own. The compiled
contenders compile the loss too (``torch.compile(loss, fullgraph=True)``); the optimiser step
is one fused kernel already. The first call of each compiled contender is timed on its own
(``first_call_s``): it is the compilation, which the timed calls no longer pay.

How it is timed, so that a ratio means what it says: the contenders take turns, in the order
A B C D D C B A, round after round, so a slow drift of the machine (these are shared machines)
and the order itself hit all alike; each ratio is the median over rounds of (contender /
nn.Transformer eager) within the round, with the lowest and highest round beside it.

Work is counted once, on the eager plain model, with ``torch.utils.flop_counter.FlopCounterMode``
(a multiply-add counts as two; matrix products and attention, nothing else). On a CPU the
achieved GFLOP/s is shown beside one large matrix product's (2048², ``a @ b``) in the same run;
on a GPU the achieved FLOP/s over the device's peak dense bf16 FLOP/s is the MFU (model FLOPs
utilisation). The peak comes from ``PEAK_BF16`` below, NVIDIA's datasheets, keyed by the name
the device reports; ``--peak-tflops`` gives one for a device the table lacks.

On a CPU the run also times one kind of store that a compiled training step makes slow:
writing the mask ``h <= 0`` of one feed-forward activation, eager and compiled, as bool and as
float, and as bool by Inductor's scalar C++ (``mask_stores``).

Defaults, per device:

- CPU: the paper's base sizes, vocabulary 1,000 (a vocabulary of 37,000 would make the one
  identical output layer dominate every time), batch 8 x 64 tokens, float32;
- CUDA: base sizes, vocabulary 37,000, the paper's batch of about 25,000 target tokens
  (200 x 128), bf16 autocast (weights and optimiser in float32).

    python benchmarks/bench_model.py                # the default device: CUDA if there is one
    python benchmarks/bench_model.py --device cpu   # the CPU, where a GPU is present
    python benchmarks/bench_model.py --small        # a quick run

Only a run with the default options writes the results file appendix C shows:
``results/model.json`` on a CPU, ``results/model_cuda.json`` on a GPU. A shorter run, for a
device lent for minutes, names its own file, which no page reads unless told to::

    python benchmarks/bench_model.py --only plain_compiled_chunked,theirs_compiled --no-eval \
        --repeats 10 --results model_cuda_chunked
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable

import torch
from common import (
    cold_compile_cache,
    machine,
    paired_ratios,
    print_table,
    synchronize,
    write_results,
)
from torch import nn
from torch.profiler import DeviceType, ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

import transformer_book as tb
from transformer_book.book.parity import to_pytorch

#: What each name in the results stands for (written into the results file).
CONTENDERS = {
    "plain": "the package's model as the chapters teach it, eager",
    "plain_compiled": "the same model compiled whole: tb.compile_model(model) = torch.compile(model, fullgraph=True), "
    "on a CPU with options={'fallback_random': True}",
    "theirs": "torch.nn.Transformer holding the same weights, eager (the baseline of every ratio)",
    "theirs_compiled": "the same nn.Transformer under torch.compile",
    "plain_scalar_compiled": "plain_compiled with Inductor's scalar C++: options={'cpp.simdlen': 1} (a CPU only)",
    "plain_compiled_chunked": "plain_compiled's training step with the loss in chunks of positions (tb.chunked_loss)",
    "plain_compiled_chunked_graphs": "plain_compiled_chunked compiled with mode='reduce-overhead' (CUDA graphs)",
}
CHUNKED = "plain_compiled_chunked"
GRAPHS = "plain_compiled_chunked_graphs"
SCALAR = "plain_scalar_compiled"
#: Inductor's option for scalar C++ loops (no at::vec types): a vector of one number.
SCALAR_OPTIONS = {"cpp.simdlen": 1}
BASELINE = "theirs"
# The results file's key for the profile of each contender's training step (those timed).
PROFILES = {"plain_compiled": "profile", "plain": "profile_eager", CHUNKED: "profile_chunked",
            GRAPHS: "profile_chunked_graphs"}  # fmt: skip

#: Peak dense bf16 tensor-core FLOP/s, from NVIDIA's datasheets (which print twice these
#: figures "with sparsity"): (a piece of the name torch.cuda.get_device_name() reports, FLOP/s,
#: the part). The first piece found in the name wins, so the specific names come first.
PEAK_BF16 = [
    ("H100 PCIe", 756e12, "H100 PCIe"),
    ("H100 NVL", 835e12, "H100 NVL"),
    ("H100", 989e12, "H100 SXM5"),
    ("H200", 989e12, "H200 SXM"),
    ("A100", 312e12, "A100"),
    ("L40S", 362e12, "L40S"),
    ("L4", 121e12, "L4"),
]


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    """The device's peak dense bf16 FLOP/s and where the figure comes from (None on a CPU or an
    unknown GPU)."""
    if override_tflops is not None:
        return override_tflops * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return None, "no peak for a CPU: compare with the matrix product measured in the same run"
    name = torch.cuda.get_device_name(device)
    for piece, flops, part in PEAK_BF16:
        if piece.lower() in name.lower():
            return flops, f"NVIDIA's datasheet for the {part}: {flops / 1e12:.0f} TFLOP/s dense bf16"
    return None, f"{name} is not in bench_model.PEAK_BF16: pass --peak-tflops"


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
            # The hint nn.Transformer's documentation offers: it spares a comparison of the mask
            # with a causal one that reads values back (and that torch.compile cannot trace).
            tgt_is_causal=True,
            src_key_padding_mask=padding,
            memory_key_padding_mask=padding,
        )
        return self.ours.generator(hidden)


def contenders(plain: tb.Transformer, compiled: bool = True) -> dict[str, nn.Module]:
    """The contenders, each on a copy of ``plain``'s weights (the compiled ones only if ``compiled``)."""
    device = next(plain.parameters()).device
    theirs = PyTorchTransformer(copy.deepcopy(plain))
    models = {"plain": plain, "theirs": theirs}
    if compiled:
        models["plain_compiled"] = tb.compile_model(copy.deepcopy(plain), device)
        if device.type == "cpu":
            models[SCALAR] = tb.compile_model(copy.deepcopy(plain), device, options=SCALAR_OPTIONS)
        # fullgraph too: a graph break in nn.Transformer would be an error here, not a slowdown.
        models["theirs_compiled"] = tb.compile_model(copy.deepcopy(theirs), device)
    return {name: models[name] for name in CONTENDERS if name in models}


def flops(fn: Callable[[], object]) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return counter.get_total_flops()


def first_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: for a compiled contender's first, its compilation."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def matmul_flops(device: torch.device, bf16: bool, repeats: int, n: int | None = None) -> float:
    """FLOP/s of one large matrix product (``n``², by default 2048² on a CPU and 8192² on a GPU, in
    bf16 where the model runs in bf16), the fastest of ``repeats + 2`` calls: the
    most a step made of matrix products could reach here."""
    n = n or (2048 if device.type == "cpu" else 8192)
    dtype = torch.bfloat16 if bf16 else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / min(first_call(lambda: a @ b, device) for _ in range(repeats + 2))


def mask_stores(device: torch.device, rows: int, width: int, repeats: int) -> dict:
    """Milliseconds to write the mask ``h <= 0`` of a ``rows × width`` float tensor (what ReLU
    keeps for its backward pass), eager and compiled, as bool (the dtype a training graph keeps)
    and as float: on a CPU, Inductor's vectorised C++ writes bools far more slowly than eager
    does, and a compiled training step writes one such mask per ReLU (appendix C). Also as bool
    by Inductor's scalar C++ (``scalar_as_bool``), the same comparison without vector types."""
    h = torch.randn(rows, width, device=device)
    fns = {"as_bool": lambda h: h <= 0, "as_float": lambda h: (h <= 0).float(), "scalar_as_bool": lambda h: h <= 0}
    result = {"elements": rows * width}
    for name, fn in fns.items():
        options = SCALAR_OPTIONS if name.startswith("scalar") else None  # a lambda of its own: its own graph
        compiled = torch.compile(fn, fullgraph=True, options=options)
        times = paired_ratios({"eager": lambda fn=fn: fn(h), "compiled": lambda c=compiled: c(h)}, "eager",
                              device, repeats)  # fmt: skip
        result[f"eager_{name}_ms"] = times["eager"]["seconds"] * 1e3
        result[f"compiled_{name}_ms"] = times["compiled"]["seconds"] * 1e3
    return result


#: How the profile's operators are grouped: (group, the pieces of an operator's name that put it there).
#: The first group with a piece in the name wins, so attention comes before the matrix products: cuDNN's
#: attention kernels on an H100 are named ``cudnn_generated_fort_native_sdpa_sm90_flash_...``, which
#: ``sm90_`` alone would put among the products (as in the model_cuda.json of 2026-11-26, run before this order).
OP_GROUPS = [
    ("Inductor's fused kernels", ("CompiledFxGraph", "cpp_fused", "triton_")),
    ("attention kernels", ("scaled_dot_product", "sdpa", "flash", "efficient_attention", "fmha")),
    ("matrix products", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
                         "gemm", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")),
    ("optimiser", ("adam", "Optimizer.step")),
]  # fmt: skip


def op_group(name: str) -> str:
    return next((group for group, pieces in OP_GROUPS if any(p.lower() in name.lower() for p in pieces)), "other")


def top_ops(fn: Callable[[], object], device: torch.device, steps: int = 3, count: int = 12) -> dict:
    """Where ``fn`` spends its time, by torch.profiler: the ``count`` operators with the most self
    time (on a GPU, the kernels' device time), per call, and the shares of the groups of
    ``OP_GROUPS``. A compiled graph's fused kernels are one entry per graph (``## Call
    CompiledFxGraph ...``) on a CPU, one per kernel (``triton_...``) on a GPU."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        synchronize(device)
    gpu = device.type == "cuda"
    key = "self_device_time_total" if gpu else "self_cpu_time_total"
    # On a GPU each kernel's time is listed twice: under the kernel, and under the operator
    # that launched it (aten::mm, a compiled graph's call). The kernels alone count it once.
    events = [e for e in prof.key_averages() if getattr(e, key) > 0 and (not gpu or e.device_type == DeviceType.CUDA)]
    total = sum(getattr(e, key) for e in events) or 1.0
    ranked = sorted(events, key=lambda e: getattr(e, key), reverse=True)
    groups: dict[str, float] = {}
    for e in ranked:
        groups[op_group(e.key)] = groups.get(op_group(e.key), 0.0) + getattr(e, key) / total
    ops = [{"op": e.key, "group": op_group(e.key), "ms_per_call": getattr(e, key) / 1e3 / steps,
            "share": getattr(e, key) / total, "calls_per_step": e.count / steps} for e in ranked[:count]]  # fmt: skip
    return {"ms_per_call": total / 1e3 / steps, "ops": ops, "groups": groups}


def same_outputs(models: dict[str, nn.Module], call: Callable[[nn.Module], torch.Tensor], bf16: bool) -> None:
    """Every contender's eval logits match nn.Transformer's: a benchmark of different
    computations would mean nothing."""
    expected = call(models[BASELINE]).float()
    for name, model in models.items():
        got = call(model).float()
        if bf16:  # bf16 rounds at every product: compare the whole, relative to its size
            error = ((got - expected).norm() / expected.norm()).item()
            assert error < 5e-2, f"{name}: logits differ from nn.Transformer's by {error:.3g} (relative)"
        else:
            tolerance = 1e-4 if expected.device.type == "cpu" else 2e-3  # a GPU's reductions: other orders
            torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance, msg=lambda m, n=name: f"{n}: {m}")


def run(
    device: torch.device,
    config: tb.ModelConfig,
    batch: int,
    length: int,
    repeats: int,
    *,
    bf16: bool = False,
    compiled: bool = True,
    peak_tflops: float | None = None,
    profile_ops: bool = True,
    matmul_size: int | None = None,
    loss_chunk: int | None = None,
    only: list[str] | None = None,
    evaluate: bool = True,
) -> dict:
    """Time the contenders (only the two eager ones with ``compiled=False``, which compiles
    nothing: the appendix runs that at a small size); returns the results file's body.
    ``only`` keeps those contenders (with ``plain`` and ``theirs``); ``evaluate=False`` times the
    training step alone."""
    tb.seed_everything(0)
    plain = tb.make_model(config).to(device)
    models = contenders(plain, compiled)
    chunked = [CHUNKED, GRAPHS] if device.type == "cuda" else [CHUNKED]  # CUDA graphs: a GPU's
    for name in chunked if compiled and loss_chunk else []:  # copies, trained by the functions below
        models[name] = copy.deepcopy(plain).eval()  # eval until its first step (same_outputs)
    if only:
        # The baseline divides every ratio, and the eager plain model's step counts the work.
        models = {name: model for name, model in models.items() if name in {*only, BASELINE, "plain"}}
    loss = tb.LabelSmoothingLoss(config.tgt_vocab_size, 0.1, config.pad_id)
    losses = {name: torch.compile(loss, fullgraph=True) if name.endswith("_compiled") else loss for name in models}
    # The book's optimiser for all (noam_optimizer: PyTorch's fused Adam where it runs).
    optimisers = {name: tb.noam_optimizer(model, config.d_model, warmup=4000)[0] for name, model in models.items()}

    generator = torch.Generator(device="cpu").manual_seed(0)
    src = torch.randint(3, config.src_vocab_size, (batch, length), generator=generator).to(device)
    tgt = torch.randint(3, config.tgt_vocab_size, (batch, length + 1), generator=generator).to(device)
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    src_mask, tgt_mask = tb.padding_mask(src), tb.causal_mask(length, device)

    def forward(model: nn.Module) -> torch.Tensor:
        with tb.trusted_ids(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            return model(src, tgt_in, src_mask, tgt_mask)

    def chunked_loss_of(model: tb.Transformer) -> torch.Tensor:
        memory = model.encode(src, src_mask)
        hidden = model.decode(memory, tgt_in, src_mask=src_mask, tgt_mask=tgt_mask)
        return tb.chunked_loss(hidden, model.generator, tgt_out, loss, loss_chunk)

    chunked_steps = {
        CHUNKED: torch.compile(chunked_loss_of, fullgraph=True),
        GRAPHS: torch.compile(chunked_loss_of, fullgraph=True, mode="reduce-overhead"),
    }

    def train_step(name: str) -> Callable[[], None]:
        model, loss_fn, optimiser = models[name], losses[name], optimisers[name]

        def step() -> None:
            model.train()
            optimiser.zero_grad(set_to_none=True)
            if name in chunked_steps:
                if name == GRAPHS:  # a new step: the graphs may reuse the last one's memory
                    torch.compiler.cudagraph_mark_step_begin()
                with tb.trusted_ids(), torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                    chunked_steps[name](model).backward()
            else:
                loss_fn(forward(model), tgt_out).backward()
            optimiser.step()

        return step

    def eval_forward(name: str) -> Callable[[], None]:
        model = models[name]

        @torch.inference_mode()
        def call() -> None:
            model.eval()
            forward(model)

        return call

    training = "train step (fwd+loss+bwd+Adam)"
    kinds = {training: train_step, "eval forward": eval_forward}
    if not evaluate:
        del kinds["eval forward"]
    # First calls (a compiled contender's compilation), eval first: the same outputs are checked
    # before any training step makes the weights part.
    evaluated = [name for name in models if name not in chunked_steps]  # their eval: plain_compiled's
    first = {("eval forward", name): first_call(eval_forward(name), device) for name in evaluated if evaluate}
    checked = models if evaluate else {n: m for n, m in models.items() if not n.endswith("_compiled")}
    for model in checked.values():
        model.eval()
    with torch.inference_mode():
        same_outputs(checked, forward, bf16)
    for name in list(models):
        try:
            first[training, name] = first_call(train_step(name), device)
            print(f"first training step of {name}: {first[training, name]:.1f} s", flush=True)
        except Exception as error:  # noqa: BLE001 (an optional contender must not end the run)
            if name != GRAPHS:
                raise
            print(f"{GRAPHS} left out: {type(error).__name__}: {str(error)[:300]}")
            del models[name]

    matmul = matmul_flops(device, bf16, repeats, matmul_size)
    peak, peak_source = peak_flops(device, peak_tflops)
    tokens = batch * length
    rows = []
    for what, make in kinds.items():
        work = flops(make("plain"))  # the same computation for every contender
        names = models if make is train_step else evaluated
        times = paired_ratios({name: make(name) for name in names}, BASELINE, device, repeats)
        for name, t in times.items():
            achieved = work / t["seconds"]
            rows.append({
                "what": what, "contender": name, "ms": t["seconds"] * 1e3, "ratio": t["ratio"],
                "ratio_min": t["ratio_min"], "ratio_max": t["ratio_max"], "first_call_s": first[what, name],
                "gflop": work / 1e9, "gflops": achieved / 1e9, "share_of_matmul": achieved / matmul,
                "mfu": achieved / peak if peak else None, "tokens_per_s": tokens / t["seconds"],
            })  # fmt: skip
    result = {
        "device": device.type, "bf16": bf16, "batch": batch, "length": length, "repeats": repeats,
        "tokens_per_step": tokens, "baseline": BASELINE, "matmul_gflops": matmul / 1e9,
        "peak_tflops": peak / 1e12 if peak else None, "peak_source": peak_source, "rows": rows,
    }  # fmt: skip
    if compiled and device.type == "cpu" and tb.compile_unavailable(device) is None:
        result["mask_stores"] = mask_stores(device, tokens, config.d_ff, 20 * repeats)
    if compiled and profile_ops:
        for name, key in PROFILES.items():
            if name in models:
                result[key] = {"what": f"{name}, {training}", **top_ops(train_step(name), device)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", help="cpu or cuda (default: cuda if there is one)")
    parser.add_argument("--small", action="store_true", help="ModelConfig.small and a short batch, for a quick check")
    parser.add_argument("--vocab", type=int, help="vocabulary size, shared and tied (CPU 1,000, CUDA 37,000)")
    parser.add_argument("--batch", type=int, help="sentences per batch (CPU 8, CUDA 200)")
    parser.add_argument("--length", type=int, help="tokens per sentence (CPU 64, CUDA 128)")
    parser.add_argument("--repeats", type=int, help="rounds of A B C D D C B A (CPU 10, CUDA 20)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="bf16 autocast (default: on CUDA)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak dense bf16 TFLOP/s, if not in the table")
    parser.add_argument("--only", help="the contenders to time, by name, comma-separated (with plain and theirs)")
    parser.add_argument("--no-eval", action="store_true", help="time the training step alone")
    parser.add_argument("--results", help="write results/<RESULTS>.json (a default run writes model[_cuda].json)")
    parser.add_argument("--loss-chunk", type=int, help="positions per chunk of the chunked loss (CUDA 4096; 0: none)")
    args = parser.parse_args()
    default_run = vars(args) == vars(parser.parse_args([]))
    cold_compile_cache()  # first_call_s: compiling, not reading an earlier run's kernels
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    vocab = args.vocab or (37000 if gpu else 1000)
    batch, length = args.batch or (200 if gpu else 8), args.length or (128 if gpu else 64)
    repeats = args.repeats or (20 if gpu else 10)
    bf16 = gpu if args.bf16 is None else args.bf16
    config = tb.ModelConfig.small(vocab) if args.small else tb.ModelConfig.base(vocab)

    loss_chunk = (4096 if gpu else 0) if args.loss_chunk is None else args.loss_chunk
    result = run(device, config, batch, length, repeats, bf16=bf16, peak_tflops=args.peak_tflops,
                 loss_chunk=loss_chunk or None, only=args.only and args.only.split(","),
                 evaluate=not args.no_eval)  # fmt: skip
    size = "small" if args.small else "base"
    title = (f"transformer_book vs nn.Transformer, eager and compiled: {device.type}, {size} sizes, "
             f"vocabulary {vocab}, batch {batch} x {length} tokens, {'bf16 autocast' if bf16 else 'float32'}, "
             f"{repeats} rounds of A B C D D C B A")  # fmt: skip
    peak = f"{result['peak_tflops']:.0f} TFLOP/s" if result["peak_tflops"] else "none"
    print_table(
        f"{title}\n{machine()}\npeak: {peak} ({result['peak_source']}); "
        f"matrix product: {result['matmul_gflops']:.0f} GFLOP/s",
        ["what", "contender", "ms", "/ nn.Transformer eager (median, min-max)", "first call s", "GFLOP/s",
         "of matmul", "MFU", "tokens/s"],
        [[r["what"], r["contender"], f"{r['ms']:.1f}", f"{r['ratio']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
          f"{r['first_call_s']:.1f}", f"{r['gflops']:.0f}", f"{r['share_of_matmul']:.0%}",
          f"{r['mfu']:.1%}" if r["mfu"] is not None else "-", f"{r['tokens_per_s']:,.0f}"] for r in result["rows"]],
    )  # fmt: skip
    for key in PROFILES.values():
        if key in result:
            print_table(
                f"Where the time goes: {result[key]['what']} (torch.profiler, self time)",
                ["op", "ms per step", "share", "calls per step"],
                [[o["op"][:70], f"{o['ms_per_call']:.2f}", f"{o['share']:.0%}", f"{o['calls_per_step']:.0f}"]
                 for o in result[key]["ops"]],
            )  # fmt: skip
            print("by group: " + ", ".join(f"{g} {v:.0%}" for g, v in result[key]["groups"].items()))
    if "mask_stores" in result:
        m = result["mask_stores"]
        print(f"writing the mask h <= 0 of {m['elements']:,} floats, ms: as bool {m['eager_as_bool_ms']:.2f} eager, "
              f"{m['compiled_as_bool_ms']:.2f} compiled, {m['compiled_scalar_as_bool_ms']:.2f} compiled scalar; "
              f"as float {m['eager_as_float_ms']:.2f} eager, {m['compiled_as_float_ms']:.2f} compiled")  # fmt: skip
    if default_run or args.results:  # appendix C reads the default runs, and those it names
        name = args.results or ("model_cuda" if gpu else "model")
        write_results(name, {"title": title, "config": dataclasses.asdict(config), "contenders": CONTENDERS,
                             **result})  # fmt: skip


if __name__ == "__main__":
    main()
