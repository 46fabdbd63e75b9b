"""Planning: pure functions from a profile and knobs to a plan (buckets, ordered ops with their moments), the
profile and the tuner."""
