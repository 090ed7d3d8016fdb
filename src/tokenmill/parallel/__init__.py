"""Scale-out: tensor parallelism over torch.distributed (tensor.py: the sharding rules; workers.py: the ranks)."""
