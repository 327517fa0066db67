"""Glue for the trainers users run, one module per trainer (``sparse_ckpt.integrations.<trainer>``).

Each module imports its trainer package only inside its functions: importing
``sparse_ckpt.integrations`` (or sparse_ckpt) never needs a trainer installed.
"""
