#!/usr/bin/env bash
# A GPU session's device checks in one command, for a borrowed machine (the device tool's
# `run`, with carry=[".whl"]) or any box with an NVIDIA GPU:
#
#   chapters   every chapter executed on cuda, all at once (one kernel each, nbclient), and
#              the values each page glues into its prose, as computed there, in glue_cuda.json;
#   tests      the package tests on cuda, six workers (`-m "not book"` and without the tests
#              of tools such a machine lacks: jupyter-book, Chromium, ruff, npm, actionlint
#              and the shell linter);
#   decoding   benchmarks/bench_decoding.py, which writes results/decoding_cuda.json;
#   model      benchmarks/bench_model.py, which writes results/model_cuda.json.
#
# On an H200 (2026-11-28) chapters+tests took 164 s, decoding 135 s and model 335 s: the
# default stages fit one call of the device tool, and model needs a second.
#
# Each stage has its own time limit, so one that hangs leaves time for the others. Logs
# and results go to $OUT (the device tool's output folder; else a new temporary folder).
# The device machine holds PyTorch but not the notebook packages: run
# scripts/device_wheels.sh here first, and they are installed from .whl/ there.
#
#   bash scripts/device_check.sh                          # chapters+tests, then decoding
#   STAGES="decoding model" bash scripts/device_check.sh  # some stages, in this order
#
# Stages joined by "+" run side by side (the chapters and the tests assert nothing about
# speed, so they may share the machine; the few timings the pages show are then taken under
# that load); the benchmarks run alone, one after the other, since they time.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$(mktemp -d)}"
# Each stage's status, and each chapter's glued values, gathered here before $OUT (the device
# tool brings back at most 8 files from it).
WORK="$(mktemp -d)"
export WORK
trap 'rm -rf "$WORK"' EXIT
# tb.glue hands values to myst-nb, which such a machine lacks (it needs Sphinx): without
# it nothing is glued. A stand-in gives the kernels myst-nb's glue record alone.
if ! python3 -c "import myst_nb" 2>/dev/null; then
    mkdir -p "$WORK/stand-in/myst_nb"
    cat >"$WORK/stand-in/myst_nb/__init__.py" <<'EOF'
"""Stand-in for myst-nb's glue (scripts/device_check.sh): the record, not the display."""
from IPython.core.formatters import format_display_data
from IPython.display import display as show


def glue(name, variable, display=True):
    bundle, metadata = format_display_data(variable)
    prefix = "application/papermill.record/"
    metadata["scrapbook"] = {"name": name, "mime_prefix": prefix}
    show({prefix + key: value for key, value in bundle.items()}, raw=True, metadata=metadata)
EOF
    export PYTHONPATH="$WORK/stand-in${PYTHONPATH:+:$PYTHONPATH}"
fi
STAGES="${STAGES:-chapters+tests decoding}"
export TRANSFORMER_BOOK_DEVICE="${TRANSFORMER_BOOK_DEVICE:-cuda}" PYTHONUNBUFFERED=1
status=0

if [ -d .whl ]; then
    python3 -m pip install --quiet --no-index --find-links .whl --no-deps num2words
    python3 -m pip install --quiet --no-index --find-links .whl altair ipykernel nbclient nbformat
fi
python3 -m pip install --quiet --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 ||
    { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import transformer_book as tb; print(tb.describe_environment(tb.get_device()))" ||
    exit 1

stage() {  # stage NAME SECONDS COMMAND...: run it, log it, report its time and exit code
    local name="$1" limit="$2" start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - start)) s (log: $name.log)" >"$WORK/$name.status"
    tail -n 20 "$OUT/$name.log" >>"$WORK/$name.status"
    return "$rc"
}

# shellcheck disable=SC2329  # called by xargs, through export -f
execute_chapter() {  # one notebook, executed in its folder as the book build does
    python3 - "$1" <<'EOF'
import json, os, sys, time
from pathlib import Path
import nbclient, nbformat
path = Path(sys.argv[1])
start = time.perf_counter()
notebook = nbformat.read(path, as_version=4)
failed = None
try:
    nbclient.NotebookClient(
        notebook, timeout=600, resources={"metadata": {"path": str(path.parent)}}
    ).execute()
except Exception as error:
    failed = error
# The values its prose shows, as glued on this device (those glued before a failure).
glued = {
    output["metadata"]["scrapbook"]["name"]: output["data"].get(
        "application/papermill.record/text/plain"
    )
    for cell in notebook.cells
    for output in cell.get("outputs", [])
    if "scrapbook" in output.get("metadata", {})
}
Path(os.environ["WORK"], f"glue-{path.stem}.json").write_text(json.dumps(glued))
if failed is not None:
    print(f"FAILED {path} after {time.perf_counter() - start:.1f} s:\n{failed}"[:4000])
    sys.exit(1)
print(f"ok     {path} in {time.perf_counter() - start:.1f} s")
EOF
}
export -f execute_chapter

run_stage() {  # run_stage NAME: one stage, by name
    case "$1" in
    chapters)
        stage chapters 200 bash -c \
            'ls chapters/*.ipynb chapters/appendix/*.ipynb | xargs -P 16 -I{} bash -c "execute_chapter {}"'
        local rc=$?
        # Every page's glued values in one file, by page: the prose's numbers on this device
        # (the timings among them taken beside the other pages and the tests).
        python3 -c 'import json, pathlib, sys; print(json.dumps({p.stem[5:]: json.loads(
            p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("glue-*.json"))},
            indent=1))' "$WORK" >"$OUT/glue_${TRANSFORMER_BOOK_DEVICE%%:*}.json" ||
            echo "the glued values could not be gathered" >&2
        return "$rc"
        ;;
    tests)
        # Left out: the tests of tools such a machine lacks (ruff, npm, jupyter-book,
        # Chromium, actionlint, shellcheck), none of which touches the GPU.
        stage tests 200 python3 -m pytest -q -p no:cacheprovider -m "not book" -n 6 \
            --ignore tests/test_lint.py --ignore tests/test_live.py --ignore tests/test_book.py \
            -k "not actionlint and not shellcheck"
        ;;
    decoding)
        # the results file only from a run that finished (git holds an older one)
        stage decoding 240 python3 benchmarks/bench_decoding.py &&
            cp benchmarks/results/decoding_cuda.json "$OUT/"
        ;;
    model)
        # the results file only from a run that finished (git holds an older one)
        stage model 420 python3 benchmarks/bench_model.py &&
            cp benchmarks/results/model_cuda.json "$OUT/"
        ;;
    *) echo "unknown stage $1" >"$WORK/$1.status" && return 1 ;;
    esac
}

for group in $STAGES; do
    pids=()
    for name in ${group//+/ }; do
        run_stage "$name" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || status=1
    done
    for name in ${group//+/ }; do
        cat "$WORK/$name.status"
    done
done
exit "$status"
