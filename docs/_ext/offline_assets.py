"""Sphinx extension: keep the book's pages free of stray scripts.

Jupyter Book 1.x adds *every* ``.js`` and ``.css`` file under ``_static/`` to every
page (``jupyter_book/config.py`` globs the folder). For the vendored MathJax that
would mean loading its extensions, menu and accessibility code as page scripts, and
loading MathJax twice. This extension runs once the configuration is ready and

* drops every script under ``_static/vendor/mathjax/`` (``sphinx.ext.mathjax`` loads
  MathJax from ``mathjax_path``; MathJax fetches its own fonts and extensions from
  that folder when a page needs them), and
* drops duplicates, keeping the first occurrence, so the scripts listed in
  ``_config.yml`` (``vega-offline.js`` first, then Vega, Vega-Lite, Vega-Embed) keep
  their order ahead of anything the glob appended.
"""

from __future__ import annotations

from sphinx.application import Sphinx
from sphinx.config import Config

_MATHJAX_DIR = "vendor/mathjax/"


def _name(entry) -> str:
    return entry[0] if isinstance(entry, (tuple, list)) else entry


def _prune(app: Sphinx, config: Config) -> None:
    seen: set[str] = set()
    kept = []
    for entry in config.html_js_files:
        name = _name(entry)
        if name in seen or name.startswith(_MATHJAX_DIR):
            continue
        seen.add(name)
        kept.append(entry)
    config.html_js_files = kept


def setup(app: Sphinx) -> dict:
    # Priority < 500 so this runs before Sphinx's own config-inited handlers.
    app.connect("config-inited", _prune, priority=100)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
