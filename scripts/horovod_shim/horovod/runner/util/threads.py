"""``in_thread``, which Horovod's test utilities (test/utils/common.py) import at module level."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Start ``target(*args)`` on a background thread and return the thread."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, got {type(args).__name__}")

    def run(*a):
        try:
            target(*a)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
