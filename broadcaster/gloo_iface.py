"""The network interface a gloo weight group binds: the one that routes to the rendezvous host.

Left to itself, gloo (torch's ``ProcessGroupGloo`` default device) binds the address this host's
name resolves to, and advertises it to the other ranks through the rendezvous store. Where the
host name maps to a loopback address (``127.0.0.1 vm`` / ``127.0.1.1 host`` in ``/etc/hosts``,
common on Debian and in containers), every rank advertises ``127.0.0.1``: ranks on one host still
connect, but ranks on two hosts do not (``connectFullMesh failed ... Connection refused,
remote=[127.0.0.1]:PORT``). :func:`pin_gloo_interface` sets ``GLOO_SOCKET_IFNAME`` to the interface
whose IPv4 address the kernel picks to reach the rendezvous host (a UDP ``connect``, no packet
sent), before the group is made; every rank of a group uses the same rendezvous host, so each
binds the interface facing it (the trainer, hosting the store, its own address's interface).

Invariants: a ``GLOO_SOCKET_IFNAME`` the user set is never overridden; one this module set is
replaced when a later group rendezvouses elsewhere, also in a child process that inherited it
(the value is marked by ``RLBUS_GLOO_IFNAME_PINNED``, which child processes inherit with it: a
process that pinned ``lo`` for a local group must not hand ``lo`` to a component it starts on
another network); where the route or the interface cannot be
found (IPv6-only host, unresolvable name, no Linux ``SIOCGIFADDR``) the environment is left as
it is (gloo's default). Linux only (``fcntl.ioctl`` ``SIOCGIFADDR``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

ENV_GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
"""The variable torch's gloo reads for the interface(s) to bind (comma-separated names)."""

SIOCGIFADDR = 0x8915
"""Linux ioctl: the IPv4 address of an interface (``<linux/sockios.h>``)."""

ENV_PINNED = "RLBUS_GLOO_IFNAME_PINNED"
"""Set to the value this module wrote into ``GLOO_SOCKET_IFNAME``, to tell it from the user's (a
``GLOO_SOCKET_IFNAME`` equal to it was pinned by rlbus, here or in a parent process)."""


def local_address_towards(host: str, port: int = 9) -> str | None:
    """The IPv4 address of this host that the kernel uses to reach ``host`` (a UDP socket's
    ``connect``: routing only, nothing is sent), or None when ``host`` cannot be resolved or routed."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return str(s.getsockname()[0])
    except OSError:  # socket.gaierror included
        return None


def interface_of(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` (e.g. ``"eth0"``, ``"lo"``), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = socket.inet_ntoa(fcntl.ioctl(s.fileno(), SIOCGIFADDR, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            if got == address:
                return name
    return None


def pin_gloo_interface(host: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface facing ``host`` (module docstring).

    Args:
        host: the group's rendezvous host (``broadcast.host``: the trainer's address).

    Returns:
        the interface gloo will bind: the user's ``GLOO_SOCKET_IFNAME`` if set, else the one found
        (written into ``os.environ``), else None (environment unchanged: gloo's default).
    """
    current = os.environ.get(ENV_GLOO_IFNAME)
    if current and current != os.environ.get(ENV_PINNED):
        return current
    address = local_address_towards(host)
    name = interface_of(address) if address else None
    if name is None:
        return current
    os.environ[ENV_GLOO_IFNAME] = os.environ[ENV_PINNED] = name
    return name
