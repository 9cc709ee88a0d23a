"""How the trainer spreads over devices, ranks and threads: ``distributed`` (the data-parallel group
under torchrun: each rank's share of a step's micro-batches, gradient and step-stat reduction),
``sharding`` (FSDP2 with ``trainer.parallel: fsdp``: activation checkpointing, sharded clipping and
checkpoints, the weights gathered one tensor at a time for the producers), ``follower`` (the ranks
> 0, which open no bus socket), ``placement`` (the device a rank's policy lives on) and ``threads``
(the CPU threads that follow the producers: few while they sample, all while they wait).
"""
