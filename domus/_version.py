"""The one version string of Domus (``domus.__version__``, ``domus --version``)."""

__version__ = "0.1.0"
