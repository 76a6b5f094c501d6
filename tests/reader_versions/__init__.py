"""Reader versions for the Build-it checker, written the way a reader would write them, one per file
per chapter: ``WRONG`` lists ``(part, mistake, version)``, ``RIGHT`` lists ``(part, version)``.

They share no code with the catalogue in ``transformer_book.book.exercises``; together with the
``BROKEN`` bank of tests/test_exercises.py they give every graded part at least six wrong versions.
"""

from reader_versions import ch04_heads, ch05_masking, ch06_encoder, ch08_training, ch09_inference, ch11_subwords

WRONG = [
    *ch04_heads.WRONG,
    *ch05_masking.WRONG,
    *ch06_encoder.WRONG,
    *ch08_training.WRONG,
    *ch09_inference.WRONG,
    *ch11_subwords.WRONG,
]
RIGHT = [
    *ch05_masking.RIGHT,
    *ch06_encoder.RIGHT,
    *ch08_training.RIGHT,
    *ch09_inference.RIGHT,
    *ch11_subwords.RIGHT,
]
