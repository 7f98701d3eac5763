"""Several processes for one model: tensor parallelism on one machine (shared-memory all-reduce, gloo for
set-up), the CPU binding of each rank, and the sharding of a model's weights by rank."""
