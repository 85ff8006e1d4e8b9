"""The rows `unbroken run` is compared with torchrun on (tests/integration/test_torchrun_compat.py
runs each under both; tests/unit checks the table covers the flags torchrun users pass)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Exit(enum.Enum):
    OK = "0"
    WORKER_FAILURE = "worker failure"  # 1 from both
    USAGE = "usage"  # 2 from both: argparse rejected the command line
    BAD_INPUT = "bad input"  # torchrun: non-zero (1, a traceback); unbroken: 2, one line


@dataclass
class Case:
    name: str
    args: tuple[str, ...]  # launcher flags; {port}, {log_dir}, {scripts} are filled in
    script: str = "worker"  # worker: compat_worker.py; shell: compat_worker.sh; module: -m
    script_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)  # launcher env, placeholders filled
    exit: Exit = Exit.OK
    ranks: int = 2  # rank files expected, rank0.json ... (0: no worker may run)
    agents: int = 1  # launchers started at once, on one port
    expect: dict[str, object] = field(default_factory=dict)  # in every rank file; {rank}
    console: tuple[str, ...] | None = None  # worker lines on the console: out0, err1, ...
    prefix: str = ""  # what the shown lines start with; {rank} is filled in
    logs: tuple[str, ...] | None = None  # *.log and *.json files below <run_id>_*/
    log_has: dict[str, tuple[str, ...]] = field(default_factory=dict)
    log_lacks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bad_flag: tuple[str, ...] = ()  # USAGE/BAD_INPUT: unbroken's one line names one of these
    note: str = ""


STANDALONE = ("--standalone", "--nproc-per-node", "2")


C10D = ("--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}")


ALL_LINES = ("out0", "err0", "out1", "err1")


ALL_LOGS = ("attempt_0/0/stdout.log", "attempt_0/0/stderr.log",
            "attempt_0/1/stdout.log", "attempt_0/1/stderr.log")


PREFIX_TEMPLATE = "[${role_name}-${rank}]:"


MESSAGE = "compat worker failure on rank {rank}"  # as tests/scripts/compat_worker.py raises


CASES = [
    # -- flags: rendezvous and sizes
    Case("standalone", STANDALONE, console=ALL_LINES),
    Case("nproc_underscore", ("--standalone", "--nproc_per_node", "2")),
    Case("static_master_addr_port",
         ("--nnodes", "1", "--node-rank", "0", "--master-addr", "127.0.0.1",
          "--master-port", "{port}", "--nproc-per-node", "2"), script_args=("--init", "tcp")),
    Case("c10d_rdzv_id", (*C10D, "--rdzv-id", "compat-job", "--nproc-per-node", "2"),
         expect={"TORCHELASTIC_RUN_ID": "compat-job", "GROUP_WORLD_SIZE": "1"}),
    Case("static_backend_endpoint",
         ("--rdzv-backend", "static", "--rdzv-endpoint", "127.0.0.1:{port}", "--node_rank", "0",
          "--nproc-per-node", "2"), script_args=("--init", "tcp")),
    Case("role", (*STANDALONE, "--role", "trainer", "--tee", "3"),
         expect={"ROLE_NAME": "trainer"}, console=ALL_LINES, prefix="[trainer{rank}]:"),
    Case("monitor_interval", (*STANDALONE, "--monitor-interval", "0.5")),
    Case("start_method_fork", (*STANDALONE, "--start-method", "fork")),
    Case("shutdown_timeout", (*STANDALONE, "--shutdown-timeout", "5")),
    Case("signals_to_handle", (*STANDALONE, "--signals-to-handle", "SIGTERM,SIGINT")),
    Case("rdzv_conf", (*C10D, "--rdzv-id", "conf", "--nproc-per-node", "2",
                       "--rdzv-conf", "join_timeout=60,last_call_timeout=1")),
    Case("local_addr", (*C10D, "--rdzv-id", "addr", "--nproc-per-node", "2",
                        "--local-addr", "127.0.0.1")),
    Case("event_log_handler", (*STANDALONE, "--event-log-handler", "null")),
    Case("virtual_local_rank", (*STANDALONE, "--virtual-local-rank"),
         expect={"LOCAL_RANK": "0"}),
    # -- restarts and failures
    Case("max_restarts_recovers", (*STANDALONE, "--max-restarts", "1"),
         script_args=("--fail-first",),
         expect={"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"}),
    Case("failing_script", STANDALONE, script_args=("--raise-on-rank", "1"),
         exit=Exit.WORKER_FAILURE),
    Case("failing_script_record", STANDALONE, script_args=("--raise-on-rank", "1", "--record"),
         exit=Exit.WORKER_FAILURE),
    Case("failing_script_record_log_dir", (*STANDALONE, "--log-dir", "{log_dir}"),
         script_args=("--raise-on-rank", "1", "--record"), exit=Exit.WORKER_FAILURE,
         logs=("attempt_0/1/error.json",),
         log_has={"attempt_0/1/error.json": (MESSAGE.replace("{rank}", "1"),)},
         note="@record's error file in torchrun's layout: attempt_0/<local_rank>/error.json"),
    # -- what is run
    Case("module", ("--standalone", "--nproc-per-node", "2", "-m"), script="module",
         env={"PYTHONPATH": "{scripts}"}, expect={"main_module": "compat_pkg.worker"}),
    Case("no_python", (*STANDALONE, "--no-python"), script="shell"),
    Case("no_python_module_refused", (*STANDALONE, "--no-python", "-m"), script="shell",
         exit=Exit.BAD_INPUT, ranks=0, bad_flag=("--no-python", "-m", "--module"),
         note="torchrun raises ValueError after parsing (exit 1); compared as non-zero"),
    Case("run_path", (*STANDALONE, "--run-path"), expect={"main_module": None}),
    # -- logs: redirects, tee, filters, prefix template
    Case("redirects_3_log_dir", (*STANDALONE, "--redirects", "3", "--log-dir", "{log_dir}"),
         console=(), logs=ALL_LOGS),
    Case("redirects_1_default_dir", (*STANDALONE, "--redirects", "1"),
         console=("err0", "err1"), logs=("attempt_0/0/stdout.log", "attempt_0/1/stdout.log"),
         note="no --log-dir: torchrun logs under a temp dir, unbroken under its run dir"),
    Case("redirects_map", (*STANDALONE, "-r", "0:1,1:2", "--log-dir", "{log_dir}"),
         console=("err0", "out1"), logs=("attempt_0/0/stdout.log", "attempt_0/1/stderr.log")),
    Case("tee_3", (*STANDALONE, "--tee", "3", "--log-dir", "{log_dir}"),
         console=ALL_LINES, prefix="[default{rank}]:", logs=ALL_LOGS),
    Case("tee_prefix_template", (*STANDALONE, "-t", "3", "--log-dir", "{log_dir}"),
         env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": PREFIX_TEMPLATE},
         console=ALL_LINES, prefix="[default-{rank}]:", logs=ALL_LOGS),
    Case("local_ranks_filter", (*STANDALONE, "--tee", "3", "--local-ranks-filter", "0",
                                "--log-dir", "{log_dir}"),
         console=("out0", "err0"), prefix="[default{rank}]:", logs=ALL_LOGS),
    Case("duplicate_filters", (*STANDALONE, "--tee", "3", "--duplicate-stdout-filters", "compat",
                               "--duplicate-stderr-filters", "rank=1", "--log-dir", "{log_dir}"),
         console=ALL_LINES, prefix="[default{rank}]:",
         logs=(*ALL_LOGS, "attempt_0/filtered_stdout.log", "attempt_0/filtered_stderr.log"),
         log_has={"attempt_0/filtered_stdout.log": ("compat-stdout rank=0", "compat-stdout rank=1"),
                  "attempt_0/filtered_stderr.log": ("compat-stderr rank=1",)},
         log_lacks={"attempt_0/filtered_stderr.log": ("compat-stderr rank=0",)}),
    # -- PET_* configuration
    Case("pet_kubeflow", (),
         env={"PET_NPROC_PER_NODE": "2", "PET_NNODES": "1", "PET_NODE_RANK": "0",
              "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": "{port}",
              # what a PyTorchJob pod also holds; the launcher must override it per worker
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "{port}", "WORLD_SIZE": "2",
              "RANK": "0", "PYTHONUNBUFFERED": "0"},
         note="TrainJob's PET_ set (a PyTorchJob without an elastic policy writes the same "
              "PET_NNODES/NPROC_PER_NODE/NODE_RANK), and the plain variables a PyTorchJob "
              "pod also holds"),
    Case("pet_no_python", STANDALONE, script="shell", env={"PET_NO_PYTHON": "1"}),
    Case("pet_elastic_one_agent", ("--rdzv-conf", "last_call_timeout=1"),
         env={"PET_NNODES": "1:2", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
              "PET_RDZV_ENDPOINT": "127.0.0.1:{port}", "PET_RDZV_ID": "pet-elastic"},
         expect={"TORCHELASTIC_RUN_ID": "pet-elastic", "GROUP_WORLD_SIZE": "1"}),
    Case("pet_flag_wins", (*STANDALONE, "--role", "trainer"),
         env={"PET_NPROC_PER_NODE": "1", "PET_ROLE": "from-pet"},
         expect={"ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "2"}),
    # -- elastic ranges
    Case("elastic_two_agents",
         ("--nnodes", "1:2", "--nproc-per-node", "1", *C10D, "--rdzv-id", "two",
          "--rdzv-conf", "last_call_timeout=3"), agents=2,
         expect={"GROUP_WORLD_SIZE": "2", "GROUP_RANK": "{rank}", "LOCAL_RANK": "0",
                 "TORCHELASTIC_RUN_ID": "two"}),
    Case("elastic_one_agent",
         ("--nnodes", "1:2", "--nproc-per-node", "2", *C10D, "--rdzv-id", "one",
          "--rdzv-conf", "last_call_timeout=1"),
         expect={"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}),
    # -- bad input
    Case("unknown_flag", (*STANDALONE, "--no-such-flag"), exit=Exit.USAGE, ranks=0,
         bad_flag=("--no-such-flag",)),
    Case("nnodes_reversed", ("--nnodes", "3:1"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: AssertionError (exit 1)"),
    Case("nnodes_zero", ("--nnodes", "0:2"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: AssertionError (exit 1)"),
    Case("nnodes_not_numbers", ("--nnodes", "a:b"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("--nnodes",), note="torchrun: ValueError (exit 1)"),
    Case("redirects_bad_map", (*STANDALONE, "-r", "0:9"), exit=Exit.BAD_INPUT, ranks=0,
         bad_flag=("-r", "--redirects"), note="torchrun: ValueError (exit 1)"),
]
