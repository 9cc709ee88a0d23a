"""Run files: what a run directory holds and how it is written (atomic and fsynced writes, the
trainer's checkpoint layout, the evaluation records), read by the components that resume from it
and by busctl. No sockets, no trainer code.
"""
