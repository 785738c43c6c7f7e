"""Integration tests: a real supervisor and real services, as separate
processes talking over real sockets on 127.0.0.1.

This directory is a package so that its module names (``test_cli`` ...)
cannot clash with same-named modules under tests/unit.
"""
