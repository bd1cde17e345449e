"""Every configuration or startup error is one line naming the option (and the file, for
--config), with exit status 2 and no traceback: ``python -m lmserver`` in a subprocess."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
from startup import run_lmserver, the_error

from lmserver.config import OptionError
from lmserver.server import Server
from lmserver.storage.tiers import registry
from lmserver.storage.tiers.base import Tier

# -- the configuration file: values of the wrong kind or range name the file and the key ------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("memory-limit = 1.5", "memory-limit"),
        ("disk-limit = 2.0", "disk-limit"),
        ("memory-limit = 1e300", "memory-limit"),
        ("write-behind-limit = inf", "write-behind-limit"),
        ("max-object-size = nan", "max-object-size"),
        ("memory-limit = 99999999999999999999999", "memory-limit"),
        ('memory-limit = "99999999999999999999999TiB"', "memory-limit"),
        ("port = 70000", "port"),
        ("max-connections = 1e20", "max-connections"),
        ("max-connections = 100000000000000000000", "max-connections"),
        ("max-connections-per-address = 2000000", "max-connections-per-address"),
    ],
)
def test_a_bad_value_in_the_config_file_names_the_file_and_the_key(
    tmp_path: Path, line: str, key: str
) -> None:
    config = tmp_path / "lmserver.toml"
    config.write_text(line + "\n")
    error = the_error(run_lmserver("--config", str(config)))
    assert str(config) in error and f"{key} =" in error, error
    assert "LMSERVER_" not in error  # the value came from the file, not the environment


def test_a_value_the_server_refuses_names_the_file_too(tmp_path: Path) -> None:
    config = tmp_path / "lmserver.toml"
    config.write_text('max-object-size = "3GiB"\n')  # a size, but beyond the protocol's int32
    error = the_error(run_lmserver("--config", str(config)))
    assert "--max-object-size" in error and str(config) in error, error


@pytest.mark.parametrize(
    "args", [("--max-connections", "1048577"), ("--memory-limit", "2EiB"), ("--max-list-keys", "3000000000")]
)
def test_counts_and_sizes_have_upper_bounds(args: tuple[str, ...]) -> None:
    assert args[0] in the_error(run_lmserver(*args))


# -- --allow ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "env"), [(("--allow", ""), {}), ((), {"LMSERVER_ALLOW": " , "})])
def test_an_allow_list_without_an_address_is_an_error(args: tuple[str, ...], env: dict[str, str]) -> None:
    """It let everyone in, while the listening line showed allow: [""]."""
    assert "--allow" in the_error(run_lmserver(*args, env=env))


# -- startup: what the options name cannot be had -----------------------------------------------


def test_a_garbage_tls_certificate(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate\n")
    error = the_error(run_lmserver("--tls-port", "0", "--tls-cert", str(cert)))
    assert "--tls-cert" in error and str(cert) in error


def test_a_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert "--port" in the_error(run_lmserver("--port", port))
        assert "--metrics-port" in the_error(run_lmserver("--metrics-port", port))


def test_a_file_given_as_a_disk_tier() -> None:
    """It exited 1 with "[Errno 17] File exists" and a traceback."""
    error = the_error(run_lmserver("--tier", "disk:/dev/null"))
    assert "--tier disk:/dev/null" in error and "File exists" in error


@pytest.mark.parametrize(
    "spec",
    [
        "disk:{tmp}?capacity=99999999999999999999999TiB",
        "disk:{tmp}?workers=100000000000000000000",
        "disk:{tmp}?workers=1e20",
        "disk:{tmp}?workers=4096",
    ],
)
def test_tier_options_have_bounds(tmp_path: Path, spec: str) -> None:
    assert "--tier" in the_error(run_lmserver("--tier", spec.format(tmp=tmp_path / "d")))


def test_a_disk_tier_of_no_capacity_is_refused_like_disk_limit_0(tmp_path: Path) -> None:
    assert "--disk-limit" in the_error(run_lmserver("--disk", str(tmp_path / "a"), "--disk-limit", "0"))
    assert "capacity" in the_error(run_lmserver("--tier", f"disk:{tmp_path / 'b'}?capacity=0"))


class Unopenable(Tier):
    """A tier whose open fails as any backend's might."""

    async def open(self) -> None:
        raise ValueError("the backend said no")

    async def put(self, key: str, data: memoryview, meta: Any) -> bool:
        return False

    async def get_into(self, key: str, alloc: Any) -> Any:
        return None

    def contains(self, key: str) -> bool:
        return False

    async def delete(self, key: str) -> bool:
        return False

    def keys(self, prefix: str = "") -> list[str]:
        return []

    def usage(self) -> Any:
        from lmserver.storage.tiers.base import TierUsage

        return TierUsage(0, 0, 0)

    async def close(self) -> None:
        pass


async def test_any_tier_whose_open_raises_is_a_startup_error_naming_it(tmp_path: Path) -> None:
    from lmserver.config import ServerConfig

    registry.register("unopenable", lambda spec: Unopenable())
    try:
        config = ServerConfig(port=0, memory_limit=1 << 26, disk=tmp_path / "d", tiers=("unopenable:x",))
        server = Server(config)
        with pytest.raises(OptionError) as caught:
            await server.start()
        assert caught.value.option == "--tier"
        assert str(caught.value) == "--tier unopenable:x: cannot open the tier: the backend said no"
        await server.shutdown()
    finally:
        registry.unregister("unopenable")
