"""The probe format: what a probe is on disk and on the wire, and how it scores.

`manifest` parses a probe's JSON manifest strictly and checks it against a
model; `files` reads and writes probe files (a directory or one safetensors
file, laid out as `layout` says) and confines router-side paths; `probes` is
the probe math every kind runs. It lives in `common/` because more than one
floor above reads it: the router loads and scores probes, the lifecycle trains
and checks them with the same code, and the client uploads them. Plain logic:
nothing here opens a connection or needs vLLM.
"""
