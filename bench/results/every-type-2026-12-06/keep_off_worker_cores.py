"""Once two vLLM workers are bound (bench.overhead starts vanilla vLLM's and Undercurrent's), keeps every
task of the named processes off their cores, each second. Usage: python keep_off_worker_cores.py front,router"""
import os
import subprocess
import sys
import time

what = sys.argv[1].split(",")
PAT = {"core": "VLLM::EngineCore", "front": "python -m bench.overhead", "router": "router_service"}
def pids(pat):
    return [int(p) for p in subprocess.run(["pgrep", "-f", pat], capture_output=True, text=True).stdout.split()]
def tasks(pid):
    try: return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError: return []
for _ in range(900):
    workers = pids("VLLM::Worker")
    if len(workers) >= 2:
        wcores = set()
        for w in workers:
            wcores |= os.sched_getaffinity(w)
        free = set(range(os.cpu_count())) - wcores
        if free:
            for k in what:
                for p in pids(PAT[k]):
                    for t in tasks(p):
                        try: os.sched_setaffinity(t, free)
                        except OSError: pass
    time.sleep(1)
