"""What a console instance needs to know; the CLI and tests build one of these."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ConsoleConfig:
    db_path: Path
    policy_dir: Path
    # Replicas authenticate with this; None means "use the one stored in the DB"
    # (generated on first start) so a restart does not lock replicas out.
    api_token: str | None = None
    # Flask session key; None means "stored in the DB on first start".
    secret_key: str | None = None
    # Cheap mtime poll of policy_dir, at most this often, driven by requests.
    reload_interval: float = 1.0
    stale_after_s: float = 5.0
    max_wait_s: float = 30.0
    secure_cookies: bool = False  # True behind TLS
    clock: Callable[[], float] | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, db_path: str | Path, policy_dir: str | Path, **overrides: object) -> ConsoleConfig:
        """Env vars fill in what the command line left out; secrets stay out of `ps`."""
        cfg = cls(db_path=Path(db_path), policy_dir=Path(policy_dir))
        cfg.api_token = os.environ.get("SLUICE_CONSOLE_TOKEN") or None
        cfg.secret_key = os.environ.get("SLUICE_CONSOLE_SECRET") or None
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, value)
        return cfg
