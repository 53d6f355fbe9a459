"""The lowest layer: what every other layer may use and nothing of theirs it imports.

errors (the one user-error type), files (atomic writes, append-only logs, full-disk messages),
lock (one writer per workdir), trees (flattening nested dicts), metric_names (which metrics are
better lower), tokens (the special token ids every layer agrees on), hostmem (glibc malloc
settings applied before JAX starts).
"""
