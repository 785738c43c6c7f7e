"""What both sides of the wire share: the message format (``protocol``), key
and value encoding (``keys``, ``values``), addresses (``address``), the
control plane's framing (``control``), DHT attributes (``attributes``),
launch records (``launch``) and the ``/metrics`` page the supervisor and
services serve (``metrics``).  docs/protocol.md is the specification.

Nothing here imports the client, the service, storage, the supervisor or
the operations: every side imports this package, never the reverse.
"""
