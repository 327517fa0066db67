"""Load: decode a sparse optimizer dict, match it by FQN and apply it, transactionally."""
