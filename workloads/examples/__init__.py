"""Example workloads users copy; these (and only these) import torch and horovod."""
