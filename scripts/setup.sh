#!/usr/bin/env bash
# Set up a fresh machine for building the book and running the tests:
# the pinned Python packages (the package itself included, editable), the pinned
# npm packages (onnxruntime-web, for chapter 10's page) and,
# for the browser test, Debian's Chromium when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# The browser side of chapter 10's live model: onnxruntime-web at the version package-lock.json
# pins. The book build copies its files into the site (docs/_ext/live_model.py).
if ! command -v npm >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
    else
        echo "setup: npm is missing; install Node.js (18 or later) with npm to build the book" >&2
        exit 1
    fi
fi
# npm, apt and pip write to different places: let them work at the same time.
npm ci --no-audit --no-fund --loglevel=error &
jobs_started=("$!")
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) &
        jobs_started+=("$!")
    else
        echo "setup: Chromium is missing; install Debian's 'chromium' package for the browser test" >&2
        exit 1
    fi
fi

python3 -m pip install --quiet --disable-pip-version-check -r requirements.txt
for job in "${jobs_started[@]}"; do
    wait "$job"  # under set -e, a failed npm ci or apt-get stops the setup here
done
