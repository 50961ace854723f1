"""The pure parts of rank 0's endpoint over MPI: which address rank 0 offers, the interface
each rank names for Gloo/NCCL, and the message for an mpi4py bound to another MPI. The
exchange itself runs under real mpirun/mpiexec in tests/e2e/test_mpirun.py."""

from __future__ import annotations

import socket
import sys

import pytest

from meshrun.runtime.mpi_rendezvous import (
    Endpoint,
    MpiRendezvousError,
    choose_abi,
    choose_address,
    init_socket_ifname,
    interface_of,
    local_addresses,
    mismatch_message,
    route_source,
)

pytestmark = pytest.mark.timeout(10)


def test_every_rank_on_rank_0s_host_means_loopback() -> None:
    reports = [(True, ["10.1.2.3"]), (True, ["10.1.2.3"])]
    assert choose_address(reports, {}) == "127.0.0.1"


def test_a_named_interface_gives_rank_0s_address() -> None:
    reports = [(True, []), (False, ["192.0.2.77"])]
    assert choose_address(reports, {"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"


def test_no_route_to_the_other_hosts_names_their_addresses_and_the_fix() -> None:
    # The other host reports only addresses this host holds itself (a bridge on every host).
    mine = local_addresses() or pytest.skip("no non-loopback IPv4 address here")
    with pytest.raises(MpiRendezvousError, match=r"-x MASTER_ADDR=\.\.\.") as info:
        choose_address([(True, mine), (False, mine)], {})
    assert mine[0] in str(info.value)


def test_the_route_to_another_host_gives_rank_0s_address() -> None:
    mine = local_addresses() or pytest.skip("no non-loopback IPv4 address here")
    # A documentation address (TEST-NET-3) stands for the other host: routed, never sent to.
    peer = "203.0.113.9"
    if not route_source(peer):
        pytest.skip("no default route here")
    assert choose_address([(True, mine), (False, [peer])], {}) == route_source(peer)
    assert choose_address([(True, mine), (False, [peer])], {}) in mine


def test_interfaces_and_routes_of_this_host() -> None:
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.51.100.254") == ""  # no interface holds it
    assert "127.0.0.1" not in local_addresses()


def test_free_port_can_be_bound() -> None:
    from meshrun.runtime.ports import free_port

    port = free_port("")
    with socket.socket() as sock:
        sock.bind(("", port))  # still free a moment later (nobody else took it)


def test_socket_ifname_is_set_only_across_hosts_and_only_where_unset() -> None:
    one_host = Endpoint("127.0.0.1", 29500, "", "Open MPI v4.1.4")
    env: dict[str, str] = {}
    assert init_socket_ifname(one_host, env) == [] and env == {}
    across = Endpoint("10.0.0.1", 29500, "eth-mr", "Open MPI v4.1.4")
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    assert init_socket_ifname(across, env) == ["GLOO_SOCKET_IFNAME"]
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth-mr"}


def test_the_mismatch_message_names_both_mpis_and_the_fix() -> None:
    text = mismatch_message("Open MPI v4.1.4", 2, 1, ("MPICH", "PMI_SIZE"))
    assert "MPICH's launcher as one of PMI_SIZE=2" in text
    assert "mpi4py runs Open MPI v4.1.4, which sees 1 process(es)" in text
    assert "MPI4PY_MPIABI=mpich" in text and "libmpi.so.12" in text
    assert "-genv MASTER_ADDR" in text
    text = mismatch_message("MPICH Version: 4.0.2", 4, 1, ("Open MPI", "OMPI_COMM_WORLD_SIZE"))
    assert "MPI4PY_MPIABI=openmpi" in text and "-x MASTER_ADDR=" in text


def test_open_mpis_launcher_points_mpi4py_at_open_mpi_unless_the_user_did() -> None:
    """mpi4py's wheel loads libmpi.so first: MPICH's where MPICH's development files are
    installed, and Open MPI's mpirun then started processes that could not import mpi4py."""
    if "mpi4py.MPI" in sys.modules:
        pytest.skip("mpi4py already imported in this process: nothing would be chosen")
    env: dict[str, str] = {}
    assert choose_abi("Open MPI", env) == "MPI4PY_MPIABI=openmpi, the launcher's"
    assert env == {"MPI4PY_MPIABI": "openmpi"}
    for mine in ({"MPI4PY_MPIABI": "mpich"}, {"MPI4PY_LIBMPI": "/opt/mpi/libmpi.so.40"}):
        env = dict(mine)
        assert choose_abi("Open MPI", env) == "" and env == mine
    env = {}
    assert choose_abi("MPICH", env) == "" and env == {}  # its soname differs by distribution
