"""Chaos-testing harness for commlib."""
