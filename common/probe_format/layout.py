"""The file layout of a probe on disk, shared by routers (which load it) and
clients (which upload it inline):

  - a directory holding `manifest.json` and `weights.safetensors` (weights may be
    left out when the kind needs none, e.g. a plain norm monitor);
  - a single `.safetensors` file whose header metadata holds the manifest JSON
    under the key `undercurrent.manifest`.
"""

MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "weights.safetensors"
METADATA_KEY = "undercurrent.manifest"
