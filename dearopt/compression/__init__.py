"""Communication hooks: what travels for a bucket (casts, float32 sums, ``Sparsify``, embedding rows)."""
