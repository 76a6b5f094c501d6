"""Sphinx extension: the trained dates model, live on the "Try it" page.

A page opts in with an element ``<div id="live-dates">`` in a markdown cell. Then

* that page, and only that page, loads ``_static/live/live.js`` and ``live.css``
  (Jupyter Book adds every ``.js``/``.css`` under ``_static/`` to *every* page; this
  extension takes ``live/`` back out of that list);
* when the HTML build has finished, the model is exported from the checkpoint the
  package ships today (``transformer_book.book.export.export_onnx``) into
  ``_static/live/model/``, so the page can never serve a model older than the package;
* onnxruntime-web's browser files are copied from ``node_modules/`` (installed from
  ``package.json`` by ``npm ci`` in ``scripts/setup.sh``) into ``_static/live/ort/``.
  They are not committed (the WebAssembly file alone is about 14 MB) and the page
  fetches them only when the reader starts the model. If they are missing, the build
  fails with a message that says how to install them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.errors import ExtensionError
from sphinx.util import logging

STATIC_DIR = "live/"  # under _static, in the sources and in the built site
MARKER = 'id="live-dates"'
ORT_PACKAGE = Path("node_modules") / "onnxruntime-web" / "dist"
# The wasm-only build of onnxruntime-web: its loader, the Emscripten glue it imports, the WebAssembly.
ORT_FILES = ("ort.wasm.min.js", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


def _not_on_every_page(app: Sphinx, config: Config) -> None:
    def keep(entry) -> bool:
        name = entry[0] if isinstance(entry, (tuple, list)) else entry
        return not name.startswith(STATIC_DIR)

    config.html_js_files = [e for e in config.html_js_files if keep(e)]
    config.html_css_files = [e for e in config.html_css_files if keep(e)]


def _pages(env) -> set[str]:
    if not hasattr(env, "live_model_pages"):
        env.live_model_pages = set()
    return env.live_model_pages


def _note_page(app: Sphinx, doctree: nodes.document) -> None:
    if any(MARKER in node.astext() for node in doctree.findall(nodes.raw) if "html" in node.get("format", "")):
        _pages(app.env).add(app.env.docname)


def _purge(app: Sphinx, env, docname: str) -> None:
    _pages(env).discard(docname)


def _merge(app: Sphinx, env, docnames, other) -> None:
    _pages(env).update(_pages(other) & set(docnames))


def _page_assets(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if pagename in _pages(app.env):
        app.add_css_file(STATIC_DIR + "live.css")
        app.add_js_file(STATIC_DIR + "live.js", loading_method="defer")


def ort_sources(book_root: Path) -> list[Path]:
    """onnxruntime-web's files in ``book_root/node_modules``; raises ``ExtensionError`` naming what is missing."""
    folder = book_root / ORT_PACKAGE
    missing = [name for name in ORT_FILES if not (folder / name).is_file()]
    if missing:
        raise ExtensionError(
            f"live_model: onnxruntime-web is not installed ({', '.join(missing)} missing in {folder}). "
            "Run `npm ci` in the book's root (scripts/setup.sh does) before building the book."
        )
    return [folder / name for name in ORT_FILES]


def _write_live_files(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html" or not _pages(app.env):
        return
    target = Path(app.outdir) / "_static" / STATIC_DIR
    (target / "ort").mkdir(parents=True, exist_ok=True)
    for source in ort_sources(Path(app.srcdir)):
        shutil.copy2(source, target / "ort" / source.name)

    import torch

    import transformer_book as tb
    from transformer_book.book.export import export_onnx

    exported = export_onnx(tb.trained_model("dates", device=torch.device("cpu")), target / "model")
    logging.getLogger(__name__).info(
        f"live_model: onnxruntime-web and the dates model ({exported.model_bytes:,} bytes) "
        f"written to {target} for {sorted(_pages(app.env))}"
    )


def setup(app: Sphinx) -> dict:
    app.connect("config-inited", _not_on_every_page, priority=100)
    app.connect("doctree-read", _note_page)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    # Before offline_assets' de-duplication (900), which replaces the page's script list.
    app.connect("html-page-context", _page_assets, priority=400)
    app.connect("build-finished", _write_live_files)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True, "env_version": 1}
