"""Operating a deployment: the ``domus`` command (``cli``), a whole local
deployment in one process tree (``deploy``), and shutting down and starting
again from launch records (``launch``).  The top of the import graph: it
uses the client, the service and the supervisor, and nothing imports it
(but ``domus.__main__``).
"""
