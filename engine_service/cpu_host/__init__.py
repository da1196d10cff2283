"""Tuning for CPU hosts, applied by the engine service process: where its
threads run, the engine core's priority, and checks of the host's scheduler."""
