"""Sluice ops console: Flask + HTMX over SQLite; the control plane replicas poll."""

from __future__ import annotations

from console.app import create_app
from console.config import ConsoleConfig

__all__ = ["ConsoleConfig", "create_app"]
