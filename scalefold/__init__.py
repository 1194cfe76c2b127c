"""ScaleFold: a production-grade AlphaFold2 training application for HPC clusters."""

__version__ = "0.1.0"
