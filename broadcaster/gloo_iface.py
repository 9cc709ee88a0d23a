"""The network interface a gloo weight group binds: the one that routes to the rendezvous host.
gloo binds the address the host name resolves to; where that is loopback (``127.0.1.1 host`` in ``/etc/hosts``,
common in containers) ranks on two hosts fail (``connectFullMesh failed ... remote=[127.0.0.1]``).
:func:`pin_gloo_interface` sets ``GLOO_SOCKET_IFNAME`` to the interface the kernel routes to the rendezvous host
through (UDP ``connect``, nothing sent). A user's value is never overridden; one rlbus set (marked by
``RLBUS_GLOO_IFNAME_PINNED``, inherited by children) is replaced for a group elsewhere. No route or interface: the
environment is left as it is. Linux only (``SIOCGIFADDR``).
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
"""The value rlbus wrote into ``GLOO_SOCKET_IFNAME`` (here or in a parent), to tell it from the user's."""


def local_address_towards(host: str, port: int = 9) -> str | None:
    """This host's IPv4 address the kernel routes to ``host`` through, or None (unresolvable or unroutable)."""
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
    """Set ``GLOO_SOCKET_IFNAME`` to the interface facing rendezvous ``host``; the interface gloo will bind.
    Returns the user's value if set, else the one found (written to ``os.environ``), else None (unchanged)."""
    current = os.environ.get(ENV_GLOO_IFNAME)
    if current and current != os.environ.get(ENV_PINNED):
        return current
    address = local_address_towards(host)
    name = interface_of(address) if address else None
    if name is None:
        return current
    os.environ[ENV_GLOO_IFNAME] = os.environ[ENV_PINNED] = name
    return name
