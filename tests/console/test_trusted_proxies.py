"""The login throttle's address behind reverse proxies: X-Forwarded-For counts only when the
peer is a configured proxy, and then only its rightmost untrusted address (a client cannot
choose the address its failures count against)."""

from __future__ import annotations

import pytest

from console.config import ConsoleConfig
from console.proxies import client_address, parse_networks
from tests.console.conftest import MakeConsole
from tests.console.test_login_security import attempt

LB = parse_networks(["10.0.0.0/8", "fd00::/8"])


@pytest.mark.parametrize(
    "peer,xff,want",
    [
        ("203.0.113.7", [], "203.0.113.7"),  # no proxy
        ("203.0.113.7", ["198.51.100.1"], "203.0.113.7"),  # an untrusted peer's XFF is ignored
        ("10.0.0.2", [], "10.0.0.2"),  # a proxy without the header
        ("10.0.0.2", ["198.51.100.1"], "198.51.100.1"),  # one proxy
        ("10.0.0.2", ["6.6.6.6, 198.51.100.1"], "198.51.100.1"),  # the client wrote 6.6.6.6
        (
            "10.0.0.2",
            ["6.6.6.6", "198.51.100.1, 10.1.2.3"],
            "198.51.100.1",
        ),  # two proxies, two headers
        (
            "10.0.0.2",
            ["garbage, 198.51.100.1"],
            "198.51.100.1",
        ),  # the client's garbage is never reached
        ("10.0.0.2", ["198.51.100.1, garbage"], "10.0.0.2"),  # a proxy's garbage: stop at it
        ("10.0.0.2", ["10.0.0.9, 10.0.0.3"], "10.0.0.9"),  # every hop trusted: the farthest
        ("10.0.0.2", ["198.51.100.1:51234"], "198.51.100.1"),  # with a port
        ("fd00::1", ["2001:db8::5"], "2001:db8::5"),
        ("fd00::1", ["[2001:db8::5]:443"], "2001:db8::5"),
    ],
)
def test_the_client_address(peer: str, xff: list[str], want: str) -> None:
    assert client_address(peer, xff, LB) == want
    assert client_address(peer, xff, ()) == peer  # nothing configured: the peer, always


def test_bad_proxy_settings_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="'10.0.0.300'"):
        parse_networks(["10.0.0.0/8,10.0.0.300"])


def test_the_environment_names_proxies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CONSOLE_TRUSTED_PROXIES", "127.0.0.1, 10.0.0.0/8")
    assert [str(n) for n in ConsoleConfig.from_env("x.db", "p").trusted_proxies] == [
        "127.0.0.1/32",
        "10.0.0.0/8",
    ]


def fail(c: object, addr: str, xff: str | None) -> int:
    client = c.new_client()  # type: ignore[attr-defined]
    client.environ_base["REMOTE_ADDR"] = addr
    if xff is not None:
        client.environ_base["HTTP_X_FORWARDED_FOR"] = xff
    return attempt(c, "nobody", "wrong", addr, client).status_code  # type: ignore[arg-type]


def test_behind_a_trusted_proxy_each_client_has_its_own_address_limit(
    make_console: MakeConsole,
) -> None:
    c = make_console(trusted_proxies=parse_networks(["10.0.0.2"]), login_free_failures=1000)
    free = c.sluice.throttle.addr_free
    # One client fails until its address waits; another client behind the same proxy does not wait.
    codes = [fail(c, "10.0.0.2", "198.51.100.1") for _ in range(free + 1)]
    assert codes[:free] == [401] * free and codes[free] == 429
    assert fail(c, "10.0.0.2", "198.51.100.2") == 401
    # Forging the header to the left of the proxy's entry does not buy more guesses.
    assert fail(c, "10.0.0.2", f"203.0.113.{9}, 198.51.100.1") == 429
    failed = [a["target"] for a in c.audit_rows() if a["kind"] == "auth.login_failed"]
    assert set(failed) == {"198.51.100.1", "198.51.100.2"}


def test_without_trusted_proxies_the_header_changes_nothing(make_console: MakeConsole) -> None:
    c = make_console(login_free_failures=1000)
    free = c.sluice.throttle.addr_free
    codes = [
        fail(c, "10.0.0.2", f"198.51.100.{i}") for i in range(free + 1)
    ]  # a new "client" each time
    assert codes[free] == 429  # all one address: the peer's
    assert {a["target"] for a in c.audit_rows() if a["kind"] == "auth.login_failed"} == {"10.0.0.2"}
