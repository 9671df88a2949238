"""One torchrun worker: gbprobe | gbdiscover on a real GPU, then cross-checks
the GPU gbdiscover picked against torch's own view of LOCAL_RANK's device, and
runs an NCCL all_reduce on the same store to show discovery and torch share it.
Writes <out>/<case>.<rank>.json. Usage: discover_worker.py OUTDIR CASE"""

import json
import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

out, case = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
local = int(os.environ["LOCAL_RANK"])
env = dict(os.environ)
if case == "same-gpu":
    env["LOCAL_RANK"] = "0"  # both ranks claim GPU 0: discovery must refuse
probe = subprocess.run(["bin/gbprobe", "--json"], env=env, capture_output=True, timeout=60, check=False)
found = subprocess.run(
    ["bin/gbdiscover", "--timeout", "60s"],
    input=probe.stdout,
    env=env,
    capture_output=True,
    timeout=120,
    check=False,
)
result = {
    "case": case,
    "rank": rank,
    "gbdiscover_rc": found.returncode,
    "stderr": found.stderr.decode()[-2000:],
}
try:
    result["topology"] = json.loads(found.stdout)
except ValueError:
    result["stdout"] = found.stdout.decode()[-2000:]
if found.returncode == 0:
    props = torch.cuda.get_device_properties(local)
    picked = result["topology"]["self"]["gpu"]
    result["torch_uuid"] = "GPU-" + str(props.uuid)
    result["uuid_matches_torch"] = picked["uuid"] == result["torch_uuid"]
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60))
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    result["nccl_all_reduce"] = t.tolist()
    dist.destroy_process_group()
with open(os.path.join(out, f"{case}.{rank}.json"), "w") as f:
    json.dump(result, f, indent=1)
sys.exit(0 if (found.returncode == 0) == (case != "same-gpu") else 1)
