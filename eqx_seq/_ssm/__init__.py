"""The diagonal state-space family: the shared base, S5, LRU, the residual block and
the optimiser labels."""
