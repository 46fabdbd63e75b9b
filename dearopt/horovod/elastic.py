"""``hvd.elastic`` is not supported: dearopt jobs have a fixed set of ranks.

Every name here raises :class:`NotImplementedError` when used.  For fault
tolerance, restart the job from a checkpoint (``torchrun --max-restarts`` does
this for you) and save ``model.state_dict()`` / ``optimizer.state_dict()`` on
rank 0 regularly.
"""

_MESSAGE = ("hvd.elastic.{} is not supported by dearopt.horovod: the set of ranks is fixed for the job. Restart "
            "from a checkpoint instead (e.g. torchrun --max-restarts=N, saving model and optimizer state_dict() on "
            "rank 0)")


def run(func):
    raise NotImplementedError(_MESSAGE.format("run"))


class _Unsupported:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_MESSAGE.format(type(self).__name__))


class State(_Unsupported):
    pass


class ObjectState(_Unsupported):
    pass


class TorchState(_Unsupported):
    pass


class ElasticSampler(_Unsupported):
    pass
