"""Tools built on the lesson: ``train``, the command-line trainer (``transformer-book-train``)."""
