"""meshrun: multi-node PyTorch training that is correct, fast and easy to diagnose."""

__version__ = "0.1.0"
