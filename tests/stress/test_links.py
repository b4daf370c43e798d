"""The chaos harness's per-client links (stress/links.py): node ports in Sentinel and Cluster
replies rewritten to the client's own proxies, so that its traffic to every node goes through
links a network fault can cut; and its deployments (stress/topology.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    sys.path.insert(0, str(ROOT / "stress"))  # links.py imports proxy.py as a top-level module
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "stress" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "stress"))


links = _load("links")
topology = _load("topology")

SENTINEL_REPLY = (
    b"*1\r\n*6\r\n$4\r\nname\r\n$8\r\neventbus\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n"
    b"$4\r\nport\r\n$4\r\n7000\r\n"
)
SLOTS_REPLY = b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$9\r\n127.0.0.1\r\n:7000\r\n$2\r\nid\r\n"


def _feed(rw: object, data: bytes, step: int) -> bytes:
    out, held = b"", b""
    for i in range(0, len(data), step):
        sent, held = rw.split(held + data[i : i + step])  # type: ignore[attr-defined]
        out += sent
    return out + held


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_ports_are_rewritten_however_the_bytes_are_cut(step: int) -> None:
    ports = {7000: 41234, 7001: 5}
    sentinel = links.PortRewriter(ports, links.SENTINEL_PATTERNS)
    assert _feed(sentinel, SENTINEL_REPLY, step) == SENTINEL_REPLY.replace(
        b"$4\r\n7000", b"$5\r\n41234"
    )
    cluster = links.PortRewriter(ports, links.CLUSTER_PATTERNS)
    assert _feed(cluster, SLOTS_REPLY, step) == SLOTS_REPLY.replace(b":7000", b":41234")
    moved = b"-MOVED 3999 127.0.0.1:7001\r\n-ASK 12 127.0.0.1:7000\r\n"
    assert _feed(cluster, moved, step) == b"-MOVED 3999 127.0.0.1:5\r\n-ASK 12 127.0.0.1:41234\r\n"


def test_unknown_ports_and_other_replies_pass_unchanged() -> None:
    rw = links.PortRewriter({7000: 1}, links.CLUSTER_PATTERNS + links.SENTINEL_PATTERNS)
    other = b"*2\r\n$9\r\n127.0.0.1\r\n:6999\r\n-MOVED 1 127.0.0.1:6999\r\n$5\r\nhello\r\n"
    assert rw.split(other) == (other, b"")
    # a complete reply is never held back, even when it ends like the start of a pattern's data
    assert rw.split(b"+OK\r\n") == (b"+OK\r\n", b"")
    assert rw.split(b"$3\r\n-AS") == (b"$3\r\n", b"-AS")  # cut: the rest decides


@pytest.mark.timeout(120)
def test_a_sentinel_client_reaches_the_primary_through_its_own_links() -> None:
    """eventbus's Sentinel client asks the sentinels (through its links) for the primary and
    gets the port of its own link to it: its commands go through that link, so blackholing
    the client's links cuts it off from the primary too."""
    import anyio

    from eventbus import Settings
    from eventbus.client.connection import connect

    top = topology.Sentinel(None, down_after_ms=1000)
    hub = links.ProxyHub()
    try:
        top.start()
        client_links = links.ClientLinks(
            hub, [n.port for n in top.nodes], top.sentinel_ports, cluster=False, seed=1
        )
        settings = Settings(**top.client_settings(client_links), redis_timeout_margin_s=1)
        primary_link = client_links.links[top.target()]

        async def go() -> None:
            r = connect(settings)
            try:
                await r.set("k", "v")
                before = primary_link.stats()["bytes_up"]
                assert await r.get("k") == b"v"
                assert primary_link.stats()["bytes_up"] > before
                client_links.blackhole()
                with pytest.raises(Exception):  # noqa: B017 (a timeout or connection error)
                    await r.get("k")
                client_links.heal(drop=True)
                assert await r.get("k") == b"v"
            finally:
                await r.aclose()

        anyio.run(go)
    finally:
        hub.close()
        top.close()


@pytest.mark.timeout(120)
def test_a_cluster_client_reaches_every_node_through_its_own_links() -> None:
    import anyio

    from eventbus import Settings
    from eventbus.client.connection import connect

    top = topology.Cluster(None, replicas=0, node_timeout_ms=1000)
    hub = links.ProxyHub()
    try:
        top.start()
        client_links = links.ClientLinks(hub, [n.port for n in top.nodes], [], cluster=True, seed=1)
        settings = Settings(**top.client_settings(client_links))

        async def go() -> None:
            r = connect(settings)
            try:
                keys = [f"k{i}" for i in range(30)]  # spread over the three primaries
                for k in keys:
                    await r.set(k, k)
                nodes = {n.port for n in r.get_nodes()}
                assert nodes == {link.port for link in client_links.links.values()}
                assert all(link.stats()["bytes_up"] > 0 for link in client_links.links.values())
                assert [await r.get(k) for k in keys] == [k.encode() for k in keys]
            finally:
                await r.aclose()

        anyio.run(go)
    finally:
        hub.close()
        top.close()
