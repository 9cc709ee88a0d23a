"""The trainer as a service (``busctl serve``): the calls of training clients run on models held in memory."""
