"""Where a DHT's buckets live, shared by clients, services and the
supervisor: ``assignment`` (bucket counts in proportion to weights, and the
initial placement the direct lookup rebuilds), ``bucketmap`` (bucket ranges
-> owner) and ``layout`` (a descriptor's owners per role, moves included).
Pure: no sockets, no I/O.
"""
