"""marscli: offline speculative decoding with margin-aware verification (MARS)."""

__version__ = "0.1.0"
