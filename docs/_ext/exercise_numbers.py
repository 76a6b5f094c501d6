"""Exercises numbered per chapter (3.1, 3.2, ...) from the NN_ prefix of the file name.

Sphinx numbers enumerable nodes with one counter for the whole book unless the toctree
is numbered; this handler, run after Sphinx assigns the numbers, renumbers each
chapter's exercises in page order. sphinx-exercise reads the numbers from
env.toc_fignumbers, so titles, solutions and {ref}/{numref} links all follow.
"""

import re

CHAPTER = re.compile(r"(?:^|/)(\d+)_[^/]*$")


def renumber(app, env):
    for docname, numbers in env.toc_fignumbers.items():
        match = CHAPTER.search(docname)
        exercises = numbers.get("exercise")
        if not match or not exercises:
            continue
        in_order = sorted(exercises, key=exercises.get)
        for k, node_id in enumerate(in_order, start=1):
            exercises[node_id] = (int(match.group(1)), k)
    return []


def setup(app):
    # After sphinx's TocTreeCollector (priority 500) has assigned the numbers.
    app.connect("env-get-updated", renumber, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
