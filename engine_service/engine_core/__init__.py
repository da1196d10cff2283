"""Code loaded into vLLM's engine core process: the scheduler that holds
probed requests to --max-tokens-ahead, the engine core's wait (a vLLM
plugin), and the wire the engine service uses to reach them."""
