"""Run files: what a run directory holds and how it is written (atomic and fsynced writes, the checkpoint
layout, the evaluation records), read by the components that resume from it and by busctl."""
