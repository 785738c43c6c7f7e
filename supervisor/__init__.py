"""The Domus supervisor (installed as ``domus.supervisor``)."""
