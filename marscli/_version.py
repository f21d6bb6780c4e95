"""marscli's version: one place (pyproject.toml reads it; results, reports and profiles record it)."""

__version__ = "0.1.0"
