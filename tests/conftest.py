"""Shared test setup: every test runs real processes over gloo on loopback."""

import os

# Ranks spawned by tests inherit this: they must never wait on a real job's default timeout.
os.environ.setdefault("TORCHCOMM_TIMEOUT_SECONDS", "60")
