"""The torchcomms backend (work in progress: only availability is decided here so far)."""

from __future__ import annotations


def available() -> str | None:
    """None when a real torchcomms can be imported; otherwise why it cannot."""
    try:
        import torchcomms
    except ImportError as exc:
        return f"torchcomms cannot be imported ({exc})"
    if not hasattr(torchcomms, "new_comm"):
        return "the installed torchcomms has no new_comm (the empty PyPI placeholder?)"
    return None
