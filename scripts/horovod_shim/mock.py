"""The ``mock`` package Horovod's test utilities import, as the standard library's ``unittest.mock``."""

from unittest.mock import *  # noqa: F401,F403
