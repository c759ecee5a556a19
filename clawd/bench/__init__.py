"""Benchmarks that users can run from the installed package (`clawd bench ...`).

Boundary: measurement harnesses that drive a real daemon over HTTP, like a person would;
they never import the daemon's internals (engines, training, store). One exception: the
judge benchmark (judge.py) runs the judges in-process through the daemon's own builder
(clawd.daemon.build_judge), because a judge has no HTTP surface to drive.
"""
