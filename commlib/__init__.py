"""commlib: the communication layer trainers import instead of torch.distributed or torchcomms.

    comm = commlib.init()                       # from torchrun's environment
    comm.all_reduce(t); comm.all_gather_single(out, inp); comm.reduce_scatter_single(out, inp)
    with commlib.context(step=3, phase="backward"): ...

One stable API (torchcomms' names) over torchcomms or torch.distributed, per-collective
deadlines, typed errors naming the ranks that did not arrive, structured logs, a flight
recorder and a progress board. See README.md.
"""

from commlib.communicator import Communicator, Work
from commlib.errors import CollectiveMismatch, CollectiveTimeout, CommAborted, CommError, PeerFailure
from commlib.hooks import register_failure_hook, register_post_hook, register_pre_hook
from commlib.init import init
from commlib.observe.log import context, get_logger
from commlib.ops import Collective, OpName, PremulSum, ReduceOp, premul_sum

__all__ = [
    "Collective", "CollectiveMismatch", "CollectiveTimeout", "CommAborted", "CommError", "Communicator",
    "OpName", "PeerFailure", "PremulSum", "ReduceOp", "Work", "context", "get_logger", "init", "premul_sum",
    "register_failure_hook", "register_post_hook", "register_pre_hook",
]
