"""Backends: the engines a `Communicator` drives (torch.distributed, torchcomms)."""
