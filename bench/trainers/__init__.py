"""Trainer comparisons: a stock trainer's optimizer checkpoint against sparse_ckpt's, same model."""
