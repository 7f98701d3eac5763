"""Several processes for one model: tensor parallelism on one machine (shared-memory all-reduce, gloo for
set-up), the CPU binding of each rank, and the group a rank's parallel layers are built for
(`parallel_state`); the layers themselves own their shards (model/layers/parallel_linear.py)."""
