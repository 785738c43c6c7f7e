"""How long the supervisor waits for services (defaults of ``domus
supervisor --down-after`` and ``--push-timeout``; no Twisted here, so that
the command line can show them without loading the supervisor)."""

DOWN_AFTER = 5.0       # seconds without a heartbeat before a service is unresponsive
PUSH_TIMEOUT = 10.0    # seconds a service has to acknowledge a change of its DHTs
