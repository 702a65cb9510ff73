"""Reconcilers: observe, decide with the pure modules, act through savepoint.k8s."""
