"""From labelled examples to a live probe: capture a dataset from a running
engine (or import capture files), train a probe on it, and load it into running
routers.

Each step is its own command (`python -m probe_lifecycle capture`, `import`,
`train`, `deploy`) with a `main(argv)` a console script can expose unchanged.
"""
