"""Collective backends: one asynchronous interface (start, handle, wait on the stream, synchronize on the host)
over torch.distributed and the csrc NCCL extension; the runtime (``init``) and launcher detection."""
