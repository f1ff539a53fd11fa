"""Past one machine, on MLX's own distributed engine (``mx.distributed``, started by
``mlx.launch``): data-parallel training, and generation with a model split over the ranks.

- ``launch``: what the launcher's variables say (rank, size, backend, addresses);
- ``control``: the control connections to rank 0 (roll call, watch, rank 0's decisions);
- ``world``: joining the ranks (guarded), ``World`` (rank, group, sharing with the others);
- ``sharding``: a model split by layers (``pipeline``) or within layers (``tensor_parallel``),
  each rank reading only its own part of the weights;
- ``follow``: how the other ranks follow rank 0's chat and server.

docs/distributed.md tells how to run it.
"""
