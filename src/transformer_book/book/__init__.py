"""The book's support: what the pages need beside the model they teach.

- ``viz``       — the charts (Altair, matplotlib) every chapter draws
- ``diagrams``  — the explanatory SVG diagrams
- ``exercises`` — ``check(name, fn)``: a reader's own version graded against the package's
- ``recurrent`` — chapter 0's GRU baselines
- ``export``    — chapter 10's ONNX graphs for onnxruntime and the browser
- ``parity``    — ``to_pytorch``: PyTorch's own modules holding the same weights (appendix B)

These modules import the lesson (``transformer_book.model`` and its parts); no lesson module
imports them.
"""
