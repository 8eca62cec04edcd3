"""The insecure-bind policy (bus.security.check_bind), which `busctl hub` and `busctl up` share:
without CURVE, only loopback addresses, unless the user says the network is trusted."""

from __future__ import annotations

import pytest

from agent_bus.bus.errors import ConfigError
from agent_bus.bus.security import InsecureBindError, check_bind

FIX = "pass --curve-secret, or pass --insecure."


def test_loopback_and_ipc_addresses_need_nothing() -> None:
    for endpoint in ("tcp://127.0.0.1:7400", "tcp://[::1]:7400", "tcp://localhost:7400",
                     "ipc:///tmp/x/hub.sock"):
        assert check_bind({"--hub": endpoint, "--events": ""}, curve=False, insecure=False,
                          fix=FIX) is None, endpoint


def test_an_exposed_address_is_refused_by_the_name_the_user_gave_it() -> None:
    with pytest.raises(InsecureBindError) as caught:
        check_bind({"--hub": "tcp://127.0.0.1:7400", "--events": "tcp://0.0.0.0:7401"},
                   curve=False, insecure=False, fix=FIX)
    assert str(caught.value) == (
        "refusing to bind --events tcp://0.0.0.0:7401 without CURVE: other machines could "
        f"connect. Make keys with `busctl keys generate DIR` and {FIX}")
    assert isinstance(caught.value, ConfigError)  # busctl's one error mapping knows it


def test_the_first_exposed_address_is_named() -> None:
    with pytest.raises(InsecureBindError, match=r"^refusing to bind hub.endpoint tcp://10\.0\.0\.1:1 "):
        check_bind({"hub.endpoint": "tcp://10.0.0.1:1", "hub.events": "tcp://0.0.0.0:2"},
                   curve=False, insecure=False, fix=FIX)


def test_insecure_allows_it_and_returns_the_address_to_warn_about() -> None:
    assert check_bind({"--hub": "tcp://127.0.0.1:1", "--events": "tcp://0.0.0.0:2"},
                      curve=False, insecure=True, fix=FIX) == "tcp://0.0.0.0:2"


def test_curve_allows_any_address() -> None:
    assert check_bind({"--hub": "tcp://0.0.0.0:1"}, curve=True, insecure=False, fix=FIX) is None
