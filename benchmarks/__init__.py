"""The Domus scalability suite: each module is a command (python -m benchmarks.NAME)."""
