"""What a raw engine failure means: `Failure`, and the one reading of engines' errors.

torch's typed errors decide first (`DistNetworkError`: a transport failure, a peer's socket
went away; a `DistStoreError` that is not a timeout: the store's host, rank 0, is gone), the
text only where torch raises a plain or backend error. Typed errors are named by class name,
as a log records them, so this module needs no torch: the backends classify live exceptions
with it and the doctor classifies logged ones, on a machine that may have only the logs.
"""

from __future__ import annotations

import enum


class Failure(enum.Enum):
    """What a raw backend exception means."""

    TIMEOUT = "timeout"  # the op did not complete in time
    PEER = "peer"  # a peer died or closed the connection
    ABORTED = "aborted"  # the communicator was aborted, finalized or is dead
    OTHER = "other"


# Substrings of engine errors, lower-cased. gloo: "Operation timed out!", "Timed out waiting
# ... for recv", "Connection closed by peer", "Connection reset by peer"; nccl: watchdog
# timeouts, "NCCL communicator was aborted", remote errors; torchcomms' gloo: "pair closure".
_TIMEOUT_TEXTS = ("timed out", "timeout")
_PEER_TEXTS = (
    "closed by peer",
    "reset by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "socket closed",
    "ncclremoteerror",
)
_ABORT_TEXTS = ("aborted", "not initialized", "has been destroyed", "pair closure")

NETWORK_ERROR = "DistNetworkError"
STORE_ERROR = "DistStoreError"


def classify_text(message: str) -> Failure:
    text = message.lower()
    if any(s in text for s in _PEER_TEXTS):
        return Failure.PEER
    if any(s in text for s in _TIMEOUT_TEXTS):
        return Failure.TIMEOUT
    if any(s in text for s in _ABORT_TEXTS):
        return Failure.ABORTED
    return Failure.OTHER


def classify(error_type: str | None, message: str) -> Failure:
    """The meaning of an error of class `error_type` (torch's typed errors first) saying `message`."""
    if error_type == NETWORK_ERROR:
        return Failure.PEER
    by_text = classify_text(message)
    if error_type == STORE_ERROR and by_text is not Failure.TIMEOUT:
        return Failure.PEER
    return by_text
