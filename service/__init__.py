"""``busctl serve``'s HTTP front door: the Tinker API and xorl-client's routes over the bus (docs/service.md)."""
