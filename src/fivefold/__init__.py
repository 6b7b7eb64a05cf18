"""fivefold: plan and run 5D-parallel training of large language models."""

__version__ = "0.1.0"
