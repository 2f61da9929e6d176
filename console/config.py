"""What a console instance needs to know; the CLI and tests build one of these."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from console.proxies import Network, parse_networks


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
    # Replicas without a report for this long leave the pages and the API's list;
    # their row is deleted after replica_forget_after_s.
    replica_hide_after_s: float = 300.0
    replica_forget_after_s: float = 3600.0
    # Usage history per tenant, model and hour (console.usage) is kept this long.
    usage_retention_days: float = 90.0
    # Login throttling (console.throttle): see Throttle for the meaning of each.
    login_free_failures: int = 5
    login_addr_free_failures: int = 20
    login_window_s: float = 900.0
    login_max_delay_s: float = 900.0
    login_concurrency: int = 1
    # Reverse proxies whose X-Forwarded-For names the client (console.proxies); none: the peer is.
    trusted_proxies: tuple[Network, ...] = ()
    clock: Callable[[], float] | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, db_path: str | Path, policy_dir: str | Path, **overrides: object) -> ConsoleConfig:
        """Env vars fill in what the command line left out; secrets stay out of `ps`."""
        cfg = cls(db_path=Path(db_path), policy_dir=Path(policy_dir))
        cfg.api_token = os.environ.get("SLUICE_CONSOLE_TOKEN") or None
        token_file = os.environ.get("SLUICE_CONSOLE_TOKEN_FILE")
        if cfg.api_token is None and token_file:
            cfg.api_token = read_secret_file(token_file)
        cfg.secret_key = os.environ.get("SLUICE_CONSOLE_SECRET") or None
        cfg.trusted_proxies = parse_networks([os.environ.get("SLUICE_CONSOLE_TRUSTED_PROXIES", "")])
        for key, value in overrides.items():
            if value is not None:
                setattr(cfg, key, value)
        return cfg


def read_secret_file(path: str | Path) -> str:
    """A token kept in a file (a container secret, a 0600 file the demo writes): its first line."""
    text = Path(path).read_text(encoding="utf-8").strip()
    if not text:
        raise ValueError(f"{path}: empty secret file")
    return text.splitlines()[0].strip()
