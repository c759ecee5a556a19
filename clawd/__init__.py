"""clawd: a local-first agent daemon that learns from your conversations."""

__version__ = "0.1.0"
