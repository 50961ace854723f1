"""Diagnostics that run through the real launcher: ``bench`` (links and compute)."""
