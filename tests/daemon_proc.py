"""Test-side name for the daemon launcher (kept so tests and benchmarks import one thing)."""

from hwr.daemon.launcher import DaemonProcess

__all__ = ["DaemonProcess"]
