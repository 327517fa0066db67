"""The torch.distributed.checkpoint (DCP) integration: the Stateful, the load planner, DCP items."""
