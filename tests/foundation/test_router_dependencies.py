"""The router image ships without vLLM and torch (requirements/router.txt):
its code must import and start without them."""

import subprocess
import sys

BLOCK_HEAVY_IMPORTS = (
    "import sys\n"
    "class NotInTheImage:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.partition('.')[0] in ('torch', 'vllm', 'transformers'):\n"
    "            raise ImportError(name + ' is not in the router image')\n"
    "sys.meta_path.insert(0, NotInTheImage())\n"
)


def test_router_starts_without_vllm_or_torch(tmp_path):
    code = BLOCK_HEAVY_IMPORTS + (
        "import runpy\nsys.argv = ['router_service', '--help']\n"
        "runpy.run_module('router_service', run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--probes" in result.stdout


def test_router_modules_import_without_vllm_or_torch():
    modules = ["router_service.server", "router_service.session", "common.probe_format.probes",
               "common.probe_format.files", "common.activations", "common.capture_spec"]
    code = BLOCK_HEAVY_IMPORTS + "\n".join(f"import {m}" for m in modules)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
