"""Glue for the trainers users run. Each submodule imports its trainer package itself, so
``import sparse_ckpt`` never does: ``sparse_ckpt.integrations.torchtitan`` needs torchtitan."""
