"""The typed error stays findable through the layers that wrap it (DCP's CheckpointException)."""

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

import commlib
from commlib.errors import find_comm_error

pytestmark = pytest.mark.contract


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_timeout_inside_dcps_checkpoint_exception_is_found() -> None:
    """find_comm_error finds the CollectiveTimeout inside DCP's CheckpointException."""
    timeout = commlib.CollectiveTimeout("all_gather #3 on 'world' timed out", op="all_gather", seq=3, comm="world",
                                        rank=0, missing_ranks=[1], stale_ranks=[], elapsed=2.0, deadline=2.0)
    wrapped = CheckpointException("save failed", {0: _wrap_exception(_raised(timeout)),
                                                  1: _wrap_exception(_raised(ValueError("unrelated")))})
    assert find_comm_error(wrapped) is timeout
    assert find_comm_error(_raised(RuntimeError("plain"))) is None


def test_a_cause_or_context_chain_is_followed() -> None:
    """find_comm_error follows __cause__ and __context__."""
    peer = commlib.PeerFailure("peer gone", op="all_reduce", seq=1, comm="world", rank=1)
    try:
        raise RuntimeError("training step failed") from peer
    except RuntimeError as outer:
        assert find_comm_error(outer) is peer
    aborted = commlib.CommAborted("aborted", comm="world")
    try:
        try:
            raise aborted
        except commlib.CommAborted:
            raise KeyError("while handling it")  # implicit context, no `from`
    except KeyError as outer:
        assert find_comm_error(outer) is aborted
