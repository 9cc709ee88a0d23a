"""Telemetry: the Prometheus metrics every component serves (``/metrics``, ``/health``) and the TLS
that guards those endpoints in a multi-node run (the run's CA, per-host server certificates, the
scrapers' client certificate). Imports no other project package, so the bus can count its traffic here.
"""
