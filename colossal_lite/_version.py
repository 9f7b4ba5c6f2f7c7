"""The package version (read by the CLI without importing the whole library)."""
__version__ = '0.1.0'
