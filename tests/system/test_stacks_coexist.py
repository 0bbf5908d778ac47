"""Two local stacks on one host: each port chosen free or taken from settings, no stack touching another's
files, both healthy side by side, and stopping one leaves the other healthy."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgehaul_dev import localstack

ROOT = Path(__file__).resolve().parents[2]


def _stack_ports(state: localstack.StackState) -> set[int]:
    return {state.prefect_port, state.s3_port, *state.weed_ports.values()}


def test_only_grpc_sockets_nobody_listens_on_are_removed() -> None:
    """SeaweedFS's /tmp/seaweedfs-<kind>-grpc-<port>.sock: a live one (a running server's) stays, a stale one
    (its server died) goes."""
    live_port, stale_port = localstack.free_ports(2)
    ports = {"master_grpc": live_port, "volume_grpc": stale_port}
    live, stale = localstack.grpc_socket_paths(ports)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(live))
        server.listen()
        dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        dead.bind(str(stale))  # bound, then closed without unlinking: what a killed server leaves
        dead.close()
        try:
            assert stale.is_socket() and localstack.socket_listening(live) and not localstack.socket_listening(stale)
            assert localstack.remove_stale_grpc_sockets(ports) == [stale]
            assert live.is_socket() and localstack.socket_listening(live) and not stale.exists()
        finally:
            live.unlink(missing_ok=True)
            stale.unlink(missing_ok=True)


def test_new_state_pins_configured_ports_and_chooses_the_rest_free(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    prefect_port, s3_port = localstack.free_ports(2)
    monkeypatch.setenv("EDGEHAUL_PREFECT_PORT", str(prefect_port))
    monkeypatch.setenv("EDGEHAUL_S3_PORT", str(s3_port))
    fixed = localstack.new_state(tmp_path / "a")  # what `make up` does
    again = localstack.new_state(tmp_path / "b")
    assert (fixed.prefect_port, fixed.s3_port, fixed.pinned) == (prefect_port, s3_port, ["prefect", "s3"])
    assert set(fixed.weed_ports) == set(localstack.WEED_PORTS)
    assert len(set(fixed.weed_ports.values())) == len(localstack.WEED_PORTS)
    assert not set(fixed.weed_ports.values()) & {9333, 19333, 8080, 18080, 8888, 18888, 18333}  # no fixed defaults
    assert fixed.weed_ports != again.weed_ports  # two `make up` no longer want the same internal ports
    monkeypatch.setenv("EDGEHAUL_S3_PORT", "0")  # 0: a free port, not pinned
    free = localstack.new_state(tmp_path / "c")
    assert free.pinned == ["prefect"] and free.s3_port not in (0, 8333)


@pytest.mark.integration
def test_two_stacks_side_by_side(stack: localstack.StackState, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session stack (free ports) and a `make up`-style stack with configured ports both pass health;
    a third one configured onto a taken port refuses to start; stopping the second leaves the first healthy,
    with its SeaweedFS gRPC sockets in place."""
    first = Path(stack.root)
    first_sockets = localstack.grpc_socket_paths(stack.weed_ports)
    assert localstack.health(first) == {"prefect": True, "s3": True}
    assert all(localstack.socket_listening(p) for p in first_sockets)

    prefect_port, s3_port = localstack.free_ports(2)
    monkeypatch.setenv("EDGEHAUL_PREFECT_PORT", str(prefect_port))
    monkeypatch.setenv("EDGEHAUL_S3_PORT", str(s3_port))
    second = tmp_path / "second"
    try:
        state = localstack.up(second)  # fixed_ports=True: the `make up` path
        assert (state.prefect_port, state.s3_port) == (prefect_port, s3_port)
        assert not _stack_ports(state) & _stack_ports(stack)
        assert localstack.health(second) == {"prefect": True, "s3": True}
        assert localstack.health(first) == {"prefect": True, "s3": True}
        proc = subprocess.run([sys.executable, "-m", "edgehaul_dev", "stack", "health", "--root", str(second)],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # each stack's own sockets: the filer/S3 ones in its folder, the gRPC ones of its own ports
        assert all(localstack.socket_listening(p) for p in localstack.grpc_socket_paths(state.weed_ports))
        assert all(localstack.socket_listening(p) for p in first_sockets)

        # a third stack configured onto the second's S3 port: refused before anything starts
        monkeypatch.setenv("EDGEHAUL_PREFECT_PORT", "0")
        third = localstack.new_state(tmp_path / "third")
        assert third.s3_port == s3_port and "s3" in third.pinned
        with pytest.raises(localstack.PortInUse, match="EDGEHAUL_S3_PORT"):
            localstack.start_s3(third)
        assert localstack._read_pid(tmp_path / "third", "seaweedfs") is None
    finally:
        stopped = localstack.down(second)
    assert set(stopped) >= {"prefect", "seaweedfs"}
    assert localstack.health(second) == {"prefect": False, "s3": False}
    assert localstack.health(first) == {"prefect": True, "s3": True}
    assert all(p.is_socket() and localstack.socket_listening(p) for p in first_sockets)
