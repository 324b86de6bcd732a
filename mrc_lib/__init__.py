"""mrc_lib: the library behind mrc-book.

Shared primitives live in :mod:`mrc_lib.nn`, readers in :mod:`mrc_lib.models`, the data
pipeline in :mod:`mrc_lib.data`, the official metrics in :mod:`mrc_lib.metrics` and the
training engine in :mod:`mrc_lib.train`.
"""

__version__ = "0.1.0"
