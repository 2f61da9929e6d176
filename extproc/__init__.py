"""Sluice: an Envoy ext_proc admission-control service for GPU inference backends."""

__version__ = "0.1.0"
