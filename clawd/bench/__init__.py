"""Benchmarks that users can run from the installed package (`clawd bench ...`).

Boundary: measurement harnesses that drive a real daemon over HTTP, like a person would;
they never import the daemon's internals (engines, training, store).
"""
