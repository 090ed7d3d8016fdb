"""Tensor-parallel ranks over torch.distributed: the worker processes (workers.py) and their shared-memory
all-reduce (shm.py). The sharding rules of the layers are models/sharding.py."""
