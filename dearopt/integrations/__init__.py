"""Integrations of :class:`dearopt.DistOptim` with other training libraries.

Each lives in its own module and imports its library only when that module is imported
(``import dearopt.integrations.transformers``); importing this package imports nothing heavy.

* :mod:`dearopt.integrations.transformers`: Hugging Face ``transformers.Trainer`` (``DearTrainer``); the
  guide page ``docs/transformers.md`` also covers ``accelerate``'s ``Accelerator`` in a loop of your own.
* :mod:`dearopt.integrations.lightning`: Lightning (``DearStrategy``).
* :mod:`dearopt.integrations.horovod`: Horovod's ``horovod.torch`` API
  (``import dearopt.integrations.horovod as hvd``).
"""
