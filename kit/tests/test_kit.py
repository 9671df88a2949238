"""Unit tests of the kit's parts that decide: the verdicts (judge.py), the
layout check, the exact data of step 3, the per-task environment
(lib/task.sh), lib/kit.sh's helpers, configure and summary.py. The whole
kit runs on a real Slurm in ci/slurm/hetjob-test.sh, which runs these first."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import judge
import kitdist
from collectives import DTYPES, Checks, Data

KIT = Path(__file__).resolve().parent.parent


# --- judge.py ----------------------------------------------------------------


def layout_row(simulated: bool = False) -> dict[str, Any]:
    return {
        "schema": "gpubridge.kit-layout/v1",
        "simulated": simulated,
        "components": [
            {
                "component": 0,
                "partition": "gpu-nv",
                "vendor": "nvidia",
                "nodes": ["nv0", "nv1"],
                "ranks": [0, 15],
                "require": "nvidia",
            },
            {
                "component": 1,
                "partition": "gpu-amd",
                "vendor": "amd",
                "nodes": ["amd0"],
                "ranks": [16, 23],
                "require": "amd",
            },
        ],
    }


def probe_row(node: str, comp: int, ok: bool, failed: list[str] | None = None) -> dict[str, Any]:
    part, req = ("gpu-nv", "nvidia") if comp == 0 else ("gpu-amd", "amd")
    return {
        "schema": "gpubridge.kit-probe/v1",
        "node": node,
        "component": comp,
        "partition": part,
        "require": req,
        "ok": ok,
        "rc": 0 if ok else 1,
        "failed": failed or [],
    }


def test_probe_passes_when_every_node_held() -> None:
    rows = [layout_row(), probe_row("nv0", 0, True), probe_row("nv1", 0, True), probe_row("amd0", 1, True)]
    result, reason = judge.probe(rows, 0)
    assert result == "PASS"
    assert reason.startswith("3 nodes; every requirement held: gpu-nv (nvidia, 2 node(s))")


def test_probe_fails_naming_the_first_node_and_requirement() -> None:
    msg = "gbprobe: requirement amd failed: no AMD GPU found"
    rows = [
        layout_row(),
        probe_row("nv0", 0, True),
        probe_row("nv1", 0, True),
        probe_row("amd0", 1, False, [msg]),
    ]
    assert judge.probe(rows, 0) == (
        "FAIL",
        f"component 1 (partition gpu-amd) node amd0, --require 'amd': {msg}",
    )


def test_probe_without_a_nodes_report_is_an_error() -> None:
    rows = [layout_row(), probe_row("nv0", 0, True), probe_row("amd0", 1, True)]
    result, reason = judge.probe(rows, 1)
    assert result == "ERROR"
    assert "nv1" in reason and "srun exit 1" in reason


S = "gpubridge.kit-train-summary/v1"


@pytest.mark.parametrize(
    ("rows", "rc", "want"),
    [
        ([{"schema": S, "ok": True, "reason": "fine"}], 0, ("PASS", "fine")),
        ([{"schema": S, "ok": False, "reason": "params differ"}], 1, ("FAIL", "params differ")),
        ([{"schema": S, "ok": True, "not_run": True, "reason": "needs GPUs"}], 0, ("NOT RUN", "needs GPUs")),
        (
            [{"schema": S, "ok": True, "reason": "fine"}],
            1,
            ("ERROR", "the training run reported ok but srun exited 1"),
        ),
        (
            [
                {
                    "schema": "gpubridge.kit-error/v1",
                    "rank": "3",
                    "fail": True,
                    "error": "RuntimeError: peer died",
                }
            ],
            1,
            ("FAIL", "rank 3: RuntimeError: peer died"),
        ),
        (
            [
                {
                    "schema": "gpubridge.kit-error/v1",
                    "rank": "0",
                    "fail": False,
                    "error": "ImportError: no torch",
                }
            ],
            2,
            ("ERROR", "rank 0: ImportError: no torch"),
        ),
        (
            [
                {"schema": S, "ok": True, "reason": "fine"},
                {"schema": "gpubridge.kit-error/v1", "rank": "1", "fail": False, "error": "x"},
            ],
            2,
            ("ERROR", "rank 1: x"),
        ),
        ([], 137, ("ERROR", "the training run wrote no summary (srun exit 137; see the job's output)")),
    ],
)
def test_summary_verdicts(rows: list[dict[str, Any]], rc: int, want: tuple[str, str]) -> None:
    assert judge.STEPS["train"]([layout_row(), *rows], rc) == want


def test_judge_cli_prints_result_tab_reason(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join(json.dumps(r) for r in [layout_row(True), {"schema": S, "ok": True, "reason": "a\nb"}])
        + "\nnot json\n"
    )
    out = subprocess.run(
        [sys.executable, str(KIT / "py" / "judge.py"), "train", str(rows), "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "PASS\ta b (CPU simulation: vendors simulated per component)\n"


# --- the layout check -------------------------------------------------------


COMPS: list[dict[str, Any]] = [
    {
        "component": 0,
        "partition": "gpu-nv",
        "vendor": "nvidia",
        "first_rank": 0,
        "ranks": 2,
        "nodes": ["nv0"],
    },
    {"component": 1, "partition": "gpu-amd", "vendor": "amd", "first_rank": 2, "ranks": 2, "nodes": ["amd0"]},
]


def rank_rows(assign: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """assign[rank] = (component, island vendor)."""
    return [
        {
            "rank": r,
            "component": c,
            "partition": COMPS[c]["partition"],
            "node": COMPS[c]["nodes"][0],
            "vendor_expected": COMPS[c]["vendor"],
            "island": v,
            "island_vendor": v,
        }
        for r, (c, v) in enumerate(assign)
    ]


def topo(islands: dict[str, list[int]], run_kind: str = "gpu-mixed") -> dict[str, Any]:
    return {
        "run_kind": run_kind,
        "islands": [{"label": v, "vendor": v, "ranks": rs} for v, rs in islands.items()],
    }


def test_layout_as_promised_has_no_problem() -> None:
    rows = rank_rows([(0, "nvidia"), (0, "nvidia"), (1, "amd"), (1, "amd")])
    assert kitdist.layout_problems(rows, COMPS, topo({"nvidia": [0, 1], "amd": [2, 3]})) == []


def test_layout_with_interleaved_ranks_is_named() -> None:
    rows = rank_rows([(0, "nvidia"), (1, "amd"), (0, "nvidia"), (1, "amd")])
    problems = kitdist.layout_problems(rows, COMPS, topo({"nvidia": [0, 2], "amd": [1, 3]}))
    assert "component 0 (partition gpu-nv) has ranks [0, 2], want the contiguous block 0-1" in problems
    assert "the nvidia island(s) hold ranks [0, 2], the nvidia components [0, 1]" in problems


def test_layout_with_a_node_of_the_wrong_vendor_is_named() -> None:
    rows = rank_rows([(0, "nvidia"), (0, "nvidia"), (1, "amd"), (1, "nvidia")])
    problems = kitdist.layout_problems(rows, COMPS, topo({"nvidia": [0, 1, 3], "amd": [2]}))
    assert problems[0] == (
        "rank 3 (component 1, partition gpu-amd, node amd0) is in island nvidia of vendor nvidia, "
        "but the partition is configured as amd"
    )


def test_split_test_checks_contiguity_only() -> None:
    rows = rank_rows([(0, "nvidia"), (0, "nvidia"), (1, "nvidia"), (1, "nvidia")])
    assert kitdist.layout_problems(rows, COMPS, topo({"nvidia": [0, 1], "amd": [2, 3]}, "split-test")) == []


def test_outside_a_kit_job_nothing_is_checked() -> None:
    assert kitdist.layout_problems(rank_rows([(0, "amd")]), [], topo({"nvidia": [0]})) == []


# --- step 3's data ----------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 7, 64, 257, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_any_summation_order_gives_the_reference(world: int, dtype: torch.dtype) -> None:
    """The property step 3 rests on: summing the ranks' inputs in the dtype,
    in any order, gives reduced()'s bits."""
    data = Data(world, torch.device("cpu"))
    n = 257
    want = data.reduced(dtype, n, 5, "SUM")
    inputs = [data.input(dtype, n, r, 5) for r in range(world)]
    orders = [
        list(range(world)),
        list(reversed(range(world))),
        [r for p in (0, 1) for r in range(p, world, 2)],
    ]
    for order in orders:
        acc = inputs[order[0]].clone()
        for r in order[1:]:
            acc += inputs[r]
        assert torch.equal(acc.view(torch.uint8), want.view(torch.uint8)), (world, dtype, order[:5])
    # ... and the data are not all zeros: the check can see a lost block.
    assert int(data.values(dtype, n, 0, 5).abs().sum()) > 0


def test_avg_is_the_exact_sum_divided_once() -> None:
    data = Data(3, torch.device("cpu"))
    s = data.reduced(torch.bfloat16, 100, 1, "SUM")
    assert torch.equal(data.reduced(torch.bfloat16, 100, 1, "AVG"), s / 3)


def test_compare_finds_one_flipped_bit_and_negative_zero() -> None:
    c = Checks(0)
    want = torch.tensor([1.0, 0.0, -2.5, 4.0], dtype=torch.bfloat16)
    c.compare(want.clone(), want, collective="all_reduce")
    got = want.clone()
    got.view(torch.int16)[2] ^= 1
    c.compare(got, want, collective="all_reduce", dtype="bfloat16")
    c.compare(torch.tensor([1.0, -0.0, -2.5, 4.0], dtype=torch.bfloat16), want, collective="broadcast")
    c.compare(want[:3], want, collective="all_gather")
    assert sorted(c.wrong) == [1, 2, 3]
    assert c.wrong[1]["elements_wrong"] == 1 and c.wrong[1]["index"] == 2
    assert c.wrong[2]["index"] == 1
    assert "got torch.bfloat16 x 3" in c.wrong[3]["error"]


# --- lib/task.sh ------------------------------------------------------------


def job_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "KIT_", "GPUBRIDGE_", "RANK", "LOCAL_"))
    }
    env.update(
        KIT_K="2",
        KIT_SIMULATE="1",
        WORLD_SIZE="5",
        MASTER_ADDR="10.0.0.1",
        MASTER_PORT="21000",
        KIT_NODES_0="nv0 nv1",
        KIT_TPN_0="2 2",
        KIT_NTASKS_0="4",
        KIT_OFFSET_0="0",
        KIT_NODE_OFFSET_0="0",
        KIT_PARTITION_0="gpu-nv",
        KIT_VENDOR_0="nvidia",
        KIT_REQUIRE_0="nvidia",
        KIT_PYTHON_0="/venv/cuda/python",
        KIT_NODES_1="amd0",
        KIT_TPN_1="1",
        KIT_NTASKS_1="1",
        KIT_OFFSET_1="4",
        KIT_NODE_OFFSET_1="2",
        KIT_PARTITION_1="gpu-amd",
        KIT_VENDOR_1="amd",
        KIT_REQUIRE_1="amd",
        KIT_PYTHON_1="/venv/rocm/python",
        SLURM_JOB_ID="77",
    )
    env.update(extra)
    return env


def task(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(KIT / "lib" / "task.sh"), *args], env=job_env(**env), capture_output=True, text=True, check=False
    )


def env_of(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_task_rank_mode_derives_rank_component_and_vendor() -> None:
    p = task(
        ["rank", "env"], SLURM_PROCID="3", SLURM_LOCALID="1", SLURMD_NODENAME="nv1", SLURM_RESTART_COUNT="2"
    )
    assert p.returncode == 0, p.stderr
    e = env_of(p.stdout)
    assert (e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["KIT_COMPONENT"]) == ("3", "1", "2", "0")
    assert (e["GPUBRIDGE_VENDOR"], e["GPUBRIDGE_SIM_HOSTNAME"], e["KIT_PY"]) == (
        "nvidia",
        "nv1",
        "/venv/cuda/python",
    )
    assert e["GPUBRIDGE_NAMESPACE"] == "job-77/attempt-2"
    p = task(["rank", "env"], SLURM_PROCID="4", SLURM_LOCALID="0", SLURMD_NODENAME="amd0")
    e = env_of(p.stdout)
    assert (e["RANK"], e["KIT_COMPONENT"], e["GPUBRIDGE_VENDOR"], e["KIT_PY"], e["GPUBRIDGE_NAMESPACE"]) == (
        "4",
        "1",
        "amd",
        "/venv/rocm/python",
        "job-77/attempt-0",
    )


def test_task_on_a_node_of_another_component_is_refused() -> None:
    p = task(["rank", "env"], SLURM_PROCID="4", SLURM_LOCALID="0", SLURMD_NODENAME="nv0")
    assert p.returncode == 2
    assert "component 1 runs on node nv0, which is not one of the component's nodes (amd0)" in p.stderr


def test_task_node_mode_and_python_placeholder() -> None:
    p = task(["node", "1", "@python", "-c", "x"], SLURMD_NODENAME="amd0", PATH="/usr/bin:/bin")
    assert (
        p.returncode != 0 and "/venv/rocm/python" in p.stderr
    )  # the placeholder became the component's python
    p = task(["node", "0", "env"], SLURMD_NODENAME="nv1")
    e = env_of(p.stdout)
    assert (e["KIT_NODE_RANK"], e["KIT_NPROC"], e["KIT_COMPONENT"]) == ("1", "2", "0")
    assert "RANK" not in e and "GPUBRIDGE_NAMESPACE" not in e


def test_task_without_simulation_sets_no_vendor() -> None:
    p = task(["rank", "env"], KIT_SIMULATE="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="nv0")
    assert "GPUBRIDGE_VENDOR" not in env_of(p.stdout)


# --- lib/kit.sh ---------------------------------------------------------------


def bash(script: str, **env: str) -> str:
    p = subprocess.run(
        ["bash", "-c", f". {KIT / 'lib' / 'kit.sh'}; {script}"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_expand_counts() -> None:
    assert bash("kit_expand_counts '2(x3),1'") == "2 2 2 1\n"
    assert bash("kit_expand_counts 8") == "8\n"


def test_json_str_escapes() -> None:
    s = 'a"b\\c\tx\ny'
    assert json.loads(bash('kit_json_str "$S"', S=s)) == s


def test_verdict_line_row_and_exit_codes(tmp_path: Path) -> None:
    for result, code in (("PASS", 0), ("FAIL", 1), ("ERROR", 2), ("NOT RUN", 77)):
        rows = tmp_path / f"{code}.jsonl"
        p = subprocess.run(
            [
                "bash",
                "-c",
                f". {KIT / 'lib' / 'kit.sh'}; KIT_STEP=4 KIT_STEP_NAME=sweep KIT_T0=$SECONDS "
                f"KIT_ROWS={rows} KIT_STEP_DIR={tmp_path} SLURM_JOB_ID=9; "
                f'kit_verdict "{result}" "why: it is so"',
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        assert p.returncode == code
        assert p.stdout == f"kit step 4 sweep: {result}: why: it is so\n"
        row = json.loads(rows.read_text())
        assert (row["step"], row["result"], row["exit"], row["reason"]) == (4, result, code, "why: it is so")


# --- configure ----------------------------------------------------------------


SITE = """KIT_PARTITIONS=(p-nv p-amd)
KIT_VENDORS=(nvidia amd)
KIT_NODES=(2 3)
KIT_GPUS_PER_NODE=(8 4)
KIT_REQUIRE=(nvidia amd)
KIT_PYTHON=(/a /b)
KIT_SBATCH_EXTRA=("--gpus-per-node=8 --account=ml" "")
KIT_TIME=01:00:00
"""


def copy_kit(tmp_path: Path) -> Path:
    kit = tmp_path / "kit"
    shutil.copytree(KIT, kit, ignore=shutil.ignore_patterns("out", "tests", "__pycache__", "site.env"))
    return kit


def test_configure_writes_one_component_per_partition(tmp_path: Path) -> None:
    kit = copy_kit(tmp_path)
    (kit / "site.env").write_text(SITE)
    subprocess.run([str(kit / "configure")], check=True, capture_output=True)
    text = (kit / "steps" / "3-collectives.sbatch").read_text()
    sb = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sb == [
        "#SBATCH --job-name=gbkit-3-collectives",
        f"#SBATCH --output={kit}/out/%x-%j.out",
        "#SBATCH --partition=p-nv --nodes=2 --ntasks-per-node=8 --time=01:00:00 "
        "--gpus-per-node=8 --account=ml",
        "#SBATCH hetjob",
        "#SBATCH --partition=p-amd --nodes=3 --ntasks-per-node=4 --time=01:00:00",
    ]
    assert (kit / "out").is_dir()
    before = {f: f.read_text() for f in (kit / "steps").iterdir()}
    subprocess.run([str(kit / "configure")], check=True, capture_output=True)
    assert before == {f: f.read_text() for f in (kit / "steps").iterdir()}  # idempotent
    assert text.endswith(
        (KIT / "steps" / "3-collectives.sbatch").read_text().split("# <<< kit header\n", 1)[1]
    )


def test_configure_refuses_a_bad_site_env(tmp_path: Path) -> None:
    kit = copy_kit(tmp_path)
    (kit / "site.env").write_text(SITE.replace("(nvidia amd)", "(nvidia intel)"))
    p = subprocess.run([str(kit / "configure")], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and "KIT_VENDORS[1]='intel' is not nvidia or amd" in p.stderr
    (kit / "site.env").write_text(SITE.replace("KIT_PYTHON=(/a /b)", "KIT_PYTHON=(/a)"))
    p = subprocess.run([str(kit / "configure")], capture_output=True, text=True, check=False)
    assert p.returncode == 2 and "KIT_PYTHON has 1 entries, KIT_PARTITIONS has 2" in p.stderr


# --- summary.py -----------------------------------------------------------------


def write_step(out: Path, step: int, name: str, job: int, rows: list[dict[str, Any]], result: str) -> None:
    d = out / f"step{step}-{name}-{job}"
    d.mkdir(parents=True)
    verdict = {
        "schema": "gpubridge.kit-verdict/v1",
        "step": step,
        "name": name,
        "job": job,
        "result": result,
        "exit": {"PASS": 0, "FAIL": 1, "NOT RUN": 77}[result],
        "reason": f"{name} {result.lower()}",
        "seconds": 3,
    }
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [layout_row(True), *rows, verdict]))


def summary(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(KIT / "summary.py"), str(out), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_summary_report(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_step(out, 1, "probe", 10, [probe_row("nv0", 0, True)], "PASS")
    write_step(
        out,
        1,
        "probe",
        12,
        [probe_row("nv0", 0, False, ["gbprobe: requirement nvidia failed: gone"])],
        "FAIL",
    )
    write_step(out, 4, "sweep", 11, [], "NOT RUN")
    bw = {
        "schema": "gpubridge.kit-bridge-bw/v1",
        "bytes": 1048576,
        "t_avg_us": 500.0,
        "bw_average_gbps": 2.1,
        "busbw_gbps": 2.1,
        "members": 2,
    }
    write_step(out, 2, "bridge", 13, [bw], "PASS")
    p = summary(out)
    assert p.returncode == 1  # the newest step 1 failed
    md = p.stdout
    assert "| 1 | probe | gbprobe --require on every node | **FAIL** | 12 | 3 | probe fail |" in md
    assert "| 3 | collectives | every collective x dtype x op, bit for bit | not submitted |" in md
    assert "| 4 | sweep | bridged all_reduce vs all-native in each island | NOT RUN | 11 |" in md
    assert "| 1048576 | 500.00 | 2.10 | 2.10 | 2 |" in md  # the perftest-style row
    assert "gbprobe: requirement nvidia failed: gone" in md
    assert "**CPU simulation**" in md
    p = summary(out, "--job", "10", "--job", "11", "--job", "13")
    assert p.returncode == 0 and "| 1 | probe | gbprobe --require on every node | PASS | 10 |" in p.stdout
    assert summary(tmp_path / "empty").returncode == 2


# --- gathering rows without all_gather_object ---------------------------------


def test_gather_objects_round_trips_through_tensors(tmp_path: Path) -> None:
    import torch.distributed as dist  # noqa: PLC0415

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        row = {"rank": 0, "island": "amd", "wrong": {"3": {"index": 1}}, "text": "é ✓"}
        assert kitdist.gather_objects(row, torch.device("cpu")) == [row]
    finally:
        dist.destroy_process_group()


def test_summary_sweep_table_says_when_an_island_has_one_rank(tmp_path: Path) -> None:
    fig = {"ranks": 2, "time_us": 100.0, "algbw_gbps": 4.0, "busbw_gbps": 4.0}
    row = {
        "schema": "gpubridge.kit-sweep/v1",
        "bytes": 1 << 30,
        "bridged": {**fig, "ranks": 3, "time_us": 300.0, "busbw_gbps": 1.5},
        "native": [{"island": "nvidia", **fig}, {"island": "amd", **fig, "ranks": 1, "busbw_gbps": 0.0}],
        "bridged_over_native": 3.0,
        "exact": True,
    }
    write_step(tmp_path, 4, "sweep", 5, [row], "PASS")
    md = summary(tmp_path).stdout
    assert "| 1 GiB | 1.50 | 300.00 | 4.00 (100.00 us) | 1 rank: nothing to reduce | 3.0 | yes |" in md


# --- kit_begin: the layout from Slurm's variables --------------------------------

FAKE_SCONTROL = """#!/bin/bash
# scontrol for tests: show hostnames (name[a-b] ranges) and show node -o.
if [ "$1 $2" = "show hostnames" ]; then
    IFS=, read -r -a parts <<<"$3"
    for p in "${parts[@]}"; do
        if [[ $p =~ ^(.*)\\[([0-9]+)-([0-9]+)\\]$ ]]; then
            for ((i = BASH_REMATCH[2]; i <= BASH_REMATCH[3]; i++)); do echo "${BASH_REMATCH[1]}$i"; done
        else
            echo "$p"
        fi
    done
elif [ "$1 $2 $3" = "show node -o" ]; then
    echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.0.${4: -1} NodeHostName=$4"
fi
"""


def kit_begin(tmp_path: Path, site: str, **slurm: str) -> subprocess.CompletedProcess[str]:
    kit = copy_kit(tmp_path)
    (kit / "site.env").write_text(site)
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "scontrol").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "KIT_"))}
    env.update(PATH=f"{fake}:{env['PATH']}", KIT_DIR=str(kit), SLURM_JOB_ID="4242", **slurm)
    script = f". {kit}/lib/kit.sh; kit_begin 3 collectives 2>/dev/null; "
    script += "env | grep -E '^(KIT_|WORLD_SIZE|MASTER_)' | sort"
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=False)


HET = {
    "SLURM_HET_SIZE": "2",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "nv[0-1]",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "2(x2)",
    "SLURM_JOB_PARTITION_HET_GROUP_0": "p-nv",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "amd[0-2]",
    "SLURM_TASKS_PER_NODE_HET_GROUP_1": "4,4,3",
    "SLURM_JOB_PARTITION_HET_GROUP_1": "p-amd",
}


def test_kit_begin_derives_the_layout_across_components(tmp_path: Path) -> None:
    p = kit_begin(tmp_path, SITE + "KIT_OUT=" + str(tmp_path / "out") + "\n", **HET)
    assert p.returncode == 0, p.stderr + p.stdout
    e = env_of(p.stdout)
    assert (e["WORLD_SIZE"], e["KIT_K"], e["KIT_NNODES"]) == ("15", "2", "5")
    assert (e["KIT_NODES_0"], e["KIT_TPN_0"], e["KIT_OFFSET_0"], e["KIT_NTASKS_0"]) == (
        "nv0 nv1",
        "2 2",
        "0",
        "4",
    )
    assert (e["KIT_NODES_1"], e["KIT_TPN_1"], e["KIT_OFFSET_1"], e["KIT_NTASKS_1"]) == (
        "amd0 amd1 amd2",
        "4 4 3",
        "4",
        "11",
    )
    assert (e["KIT_NODE_OFFSET_1"], e["KIT_VENDOR_1"], e["KIT_PYTHON_1"]) == ("2", "amd", "/b")
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("10.1.0.0", str(20000 + 4242 * 7 % 12000))
    rows = (tmp_path / "out" / "step3-collectives-4242" / "rows.jsonl").read_text().splitlines()
    lay = json.loads(rows[0])
    assert [c["ranks"] for c in lay["components"]] == [[0, 3], [4, 14]]
    assert lay["components"][1]["tasks_per_node"] == [4, 4, 3]


def test_kit_begin_refuses_a_job_that_is_not_the_configured_one(tmp_path: Path) -> None:
    het = {**HET, "SLURM_JOB_PARTITION_HET_GROUP_1": "debug"}
    p = kit_begin(tmp_path, SITE + "KIT_OUT=" + str(tmp_path / "out") + "\n", **het)
    assert p.returncode == 2
    assert p.stdout.startswith(
        "kit step 3 collectives: ERROR: component 1 runs in partition 'debug', site.env says 'p-amd'"
    )
    p = kit_begin(tmp_path / "b", SITE, SLURM_JOB_NODELIST="nv0")
    assert p.returncode == 2
    assert "is not a heterogeneous job" in p.stdout


# --- step 6: gbtrace's rows on step 5's trace ----------------------------------


def trace_rows(hang: str = "ok", flagged: list[int] | None = None) -> list[dict[str, Any]]:
    summ = {
        "schema": "gpubridge.trace-summary/v1",
        "op": "all_reduce",
        "group_size": 24,
        "bucket": 1 << 20,
        "bucket_label": "1M",
        "count": 40,
        "time_p50_us": 812.0,
        "time_p99_us": 990.0,
        "busbw_gbps": 1.234,
        "phases": {"bridge": 0.6, "island reduce": 0.3},
    }
    return [
        layout_row(),
        summ,
        {"schema": "gpubridge.trace-hang/v1", "status": hang, "verdict": f"group 0: {hang} verdict"},
        {"schema": "gpubridge.trace-straggler/v1", "kind": "summary", "windows": 3, "flagged": flagged or []},
        {"schema": "gpubridge.kit-trace/v1", "trace": "/out/step5-train-7/trace"},
    ]


def test_trace_verdicts() -> None:
    result, reason = judge.trace(trace_rows(), 0)
    assert result == "PASS", reason
    want = "40 collectives of 1 kinds, all complete; all_reduce <= 1MB: p50 812 us, busbw 1.234 GB/s"
    assert reason.startswith(want), reason
    assert "most time in bridge; no straggler in 3 windows" in reason
    result, reason = judge.trace(trace_rows(flagged=[5]), 0)
    assert result == "PASS" and "stragglers: rank(s) 5" in reason
    hang = ("FAIL", "/out/step5-train-7/trace: group 0: hang verdict")
    assert judge.trace(trace_rows(hang="hang"), 0) == hang
    assert judge.trace(trace_rows(), 2)[0] == "ERROR"
    assert judge.trace([layout_row()], 0)[0] == "ERROR"


def test_summary_report_has_the_trace(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_step(out, 6, "trace", 14, trace_rows()[1:], "PASS")
    md = summary(out).stdout
    row = "| all_reduce | 24 | <= 1MB | 40 | 812.00 | 990.00 | 1.234 | bridge 60%, island reduce 30% |"
    assert row in md, md


REPO = KIT.parent
GBTRACE_BIN = Path(os.environ.get("GPUBRIDGE_BIN_DIR") or REPO / "bin")


@pytest.mark.skipif(
    not os.access(GBTRACE_BIN / "gbtrace", os.X_OK), reason=f"needs gbtrace in {GBTRACE_BIN} (make build)"
)
def test_step6_runs_gbtrace_on_step5s_trace(tmp_path: Path) -> None:
    """steps/6-trace.sbatch under a fake Slurm: the newest step 5 run's trace
    (a real one: lib/trace/testdata/trace) through gbtrace summary, hang and
    stragglers, a PASS naming what it found; without a trace, NOT RUN."""
    out = tmp_path / "out"
    for job in (5, 7):  # job 7 is the newest
        shutil.copytree(REPO / "lib" / "trace" / "testdata" / "trace", out / f"step5-train-{job}" / "trace")
    site = SITE.replace("KIT_PYTHON=(/a /b)", f"KIT_PYTHON=({sys.executable} {sys.executable})")
    p = kit_begin(tmp_path, site + f"KIT_OUT={out}\n", **HET)  # the fake Slurm, the kit copy
    assert p.returncode == 0, p.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "KIT_"))}
    env.update(PATH=f"{tmp_path / 'fakebin'}:{env['PATH']}", KIT_DIR=str(tmp_path / "kit"))
    env.update(SLURM_JOB_ID="4243", GPUBRIDGE_BIN_DIR=str(GBTRACE_BIN), **HET)
    step6 = ["bash", str(tmp_path / "kit" / "steps" / "6-trace.sbatch")]
    run = subprocess.run(step6, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    line = run.stdout.strip().splitlines()[-1]
    want = "kit step 6 trace: PASS: 39 collectives of 8 kinds, all complete; all_reduce <= 512KB"
    assert line.startswith(want), line
    rows = judge.load(out / "step6-trace-4243" / "rows.jsonl")
    assert judge.of(rows, "gpubridge.kit-trace/v1")[0]["trace"] == str(out / "step5-train-7" / "trace")
    assert len(judge.of(rows, "gpubridge.trace-summary/v1")) == 8
    assert judge.of(rows, "gpubridge.trace-hang/v1")[0]["status"] == "ok"
    shutil.rmtree(out / "step5-train-5")
    shutil.rmtree(out / "step5-train-7")
    env["SLURM_JOB_ID"] = "4244"
    run = subprocess.run(step6, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 77, run.stdout + run.stderr
    assert "kit step 6 trace: NOT RUN: no trace of step 5 in" in run.stdout
