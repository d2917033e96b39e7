"""scalemon: a terminal monitor for distributed PyTorch training."""

__version__ = "0.1.0"
