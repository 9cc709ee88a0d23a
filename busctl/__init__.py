"""The control plane of rlbus, named after its CLI ``busctl``: it starts, watches, heals, scales and stops the
component processes of a run, and shows and reports on them.

Nothing in ``bus/`` imports from here, and components never do: they talk to the supervisor through bus
messages only. The modules are listed in docs/ARCHITECTURE.md, "Lifecycle and healing".
"""
