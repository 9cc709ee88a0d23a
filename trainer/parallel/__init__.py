"""How the trainer spreads over devices, ranks and threads: ``distributed`` (the data-parallel group
under torchrun: each rank's share of a step, gradient and step-stat reduction), ``sharding`` (FSDP2
with ``trainer.parallel: fsdp``), ``device`` (the device a rank's policy lives on) and ``threads``
(the CPU threads that follow the producers: few while they sample, all while they wait).
"""
