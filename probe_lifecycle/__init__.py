"""From labelled examples to a live probe: capture a dataset from a running
engine, train a probe on it, and load it into running routers.

Each step is its own command (`python -m probe_lifecycle.capture`, `.train`,
`.deploy`) with a `main(argv)` a console script can expose unchanged.
"""
