"""Only what Horovod's test utilities import from ``horovod.runner``."""
