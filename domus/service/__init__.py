"""The service side: one process per node that routes and stores buckets.

``server`` is the Twisted service (registration with the supervisor,
control operations, heartbeats); ``udp`` and the TCP frames feed datagrams
to ``handler`` (a pure function of state and message), which serves the
common requests through ``hotpath`` (C when built) and keeps a DHT's
buckets in ``hosted``; ``replycache`` answers retried changes once;
``resources`` samples the node with psutil.  Records live in
``domus.storage``.  Nothing here imports the client side.
"""
