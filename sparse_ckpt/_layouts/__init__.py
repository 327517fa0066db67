"""State layouts: how a leaf's parameter-shaped state tensors become DCP items."""
