"""Generated from proto/undercurrent; regenerate with `make proto`."""
