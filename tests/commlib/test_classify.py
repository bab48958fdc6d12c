"""What an engine's raw failure means: torch's typed errors first, the text only as a fallback.

One case per message the engines really print (gloo's and NCCL's texts as torch 2.13 raises
them, torch's store errors, torchcomms' gloo), so a rewording in a new release shows up here
as the one message that no longer classifies. The real-process tests in test_failures.py
produce the gloo ones for real.
"""

import pytest
import torch.distributed as dist

from commlib.backends.c10d import classify_exception

pytestmark = pytest.mark.contract
from commlib.failures import Failure, classify

GLOO = [
    ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 2000ms for recv operation to complete",
     Failure.TIMEOUT),
    ("[gloo/transport/tcp/unbound_buffer.cc:133] Timed out waiting 2000ms for send operation to complete",
     Failure.TIMEOUT),
    ("Operation timed out!", Failure.TIMEOUT),
    ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41785", Failure.PEER),
    ("[gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:1234: Connection reset by peer", Failure.PEER),
    ("[gloo/transport/tcp/pair.cc:610] Write error: Broken pipe", Failure.PEER),
]
NCCL = [
    ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, "
     "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.", Failure.TIMEOUT),
    ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
     "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
     "process exiting prematurely.", Failure.PEER),
    ("NCCL communicator was aborted on rank 0.", Failure.ABORTED),
    ("ProcessGroupNCCL has been destroyed", Failure.ABORTED),
    ("NCCL error in: ProcessGroupNCCL.cpp:2045, invalid usage, ncclInvalidUsage", Failure.OTHER),
]
TORCHCOMMS = [
    ("[TorchCommGloo] Timed out waiting 1000ms for recv operation to complete", Failure.TIMEOUT),
    ("[TorchCommGloo] pair closure", Failure.ABORTED),
    ("[TorchCommBackend]: not initialized", Failure.ABORTED),
]


@pytest.mark.parametrize("text, meaning", GLOO + NCCL + TORCHCOMMS)
def test_engine_texts_raised_as_torchs_backend_error(text: str, meaning: Failure) -> None:
    assert classify_exception(dist.DistBackendError(text)) is meaning
    assert classify_exception(RuntimeError(text)) is meaning  # releases that raise plain RuntimeError


@pytest.mark.parametrize("exc, meaning", [
    # The type decides, whatever the words: a transport failure is a lost peer.
    (dist.DistNetworkError("failed to recv, got 0 bytes"), Failure.PEER),
    (dist.DistNetworkError("Timed out after 30 s connecting to 10.0.0.2:29500"), Failure.PEER),
    # The store: a timeout is a timeout; any other store failure means its host (rank 0) is gone.
    (dist.DistStoreError("wait timeout after 2000ms, keys: /commlib/world/seq/3"), Failure.TIMEOUT),
    (dist.DistStoreError("Socket closed; server may have exited"), Failure.PEER),
    (dist.DistStoreError("unexpected store reply"), Failure.PEER),
    (ValueError("expected a tensor"), Failure.OTHER),
])
def test_torchs_typed_errors_come_before_the_text(exc: BaseException, meaning: Failure) -> None:
    assert classify_exception(exc) is meaning
    # The doctor reads the same meaning from a logged error (its type's name and its text).
    assert classify(type(exc).__name__, str(exc)) is meaning
