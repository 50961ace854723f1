"""``meshrun launch`` on one node: torchrun's elastic agent, run from Python.

meshrun does not start workers itself. It builds a torchrun command line and hands it
to ``torch.distributed.run`` in this process (as ``accelerate launch`` does), so users
get the real agent: c10d rendezvous, restarts, per-rank logs. What meshrun adds is
around it: sane defaults (a free local port, OMP threads per process), the one config
channel to the workers (``MESHRUN_CONFIG``), a one-line banner, and on failure a
one-screen summary naming the rank that failed first (see ``failures.py``).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from meshrun.launch.agent.environment import launch_environment, restored_environ
from meshrun.launch.agent.orphans import orphan_guard
from meshrun.launch.multinode import nodes as multinode
from meshrun.launch.multinode.handshake import Handshake, HandshakeError, publish_attempt
from meshrun.launch.multinode.netif import NetworkError
from meshrun.launch.multinode.nodes import NetworkPlan
from meshrun.launch.multinode.records import JoinTarget, local_node_info, name_list
from meshrun.launch.rundir import claim_run_dir
from meshrun.launch.spec import LaunchSpec, Rendezvous
from meshrun.launch.torchrun_flags import FLAGS
from meshrun.launch.trust.secret import resolve
from meshrun.monitor.watchdog import hang_report, hang_states, watch_for_hangs
from meshrun.runtime.logs import one_line, say_error, say_launch, say_line
from meshrun.runtime.ports import LOCAL_HOST, free_port
from meshrun.runtime.secret import NONCE_ENV, SECRET_ENV, JobSecret, SecretError, from_env

if TYPE_CHECKING:
    from meshrun.launch.replicas import GroupPlan

EXIT_INTERRUPTED = 130


def default_nproc_per_node() -> int:
    """One process per GPU; 2 on a CPU-only machine so the job is still distributed."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def build_torchrun_args(
    spec: LaunchSpec, port: int, network: NetworkPlan | None = None
) -> list[str]:
    """The torchrun argv for ``spec``; ``port`` is used when ``rdzv_endpoint`` is empty;
    ``network`` (multi-node) adds this node's address and whether it hosts the store."""
    _validate(spec)
    _check_torchrun_fields(spec)
    argv = [
        *("--rdzv-backend", spec.rdzv_backend),
        *("--rdzv-endpoint", rendezvous_endpoint(spec, port)),
        *("--rdzv-id", spec.rendezvous.rdzv_id),
        *("--nnodes", spec.rendezvous.nodes.text),
        *("--nproc-per-node", str(spec.procs_per_node)),
        *("--max-restarts", str(spec.max_restarts)),
        *("--log-dir", spec.log_dir),
        *_output_args(spec),
    ]
    if spec.rdzv_backend == "static":
        # Static rendezvous: the node rank is the group rank, as in torchrun. (c10d assigns
        # group ranks itself and ignores the flag; there the node rank names the node in
        # meshrun's handshake only.)
        argv += ["--node-rank", str(spec.rendezvous.node_rank)]
    if network is not None:
        argv += network_flags(network, spec.join_timeout_s)
    elif spec.rendezvous.endpoint is None:
        # One node: keep the workers' store on loopback too; otherwise torch advertises
        # the host's FQDN, which does not resolve on many laptops and containers.
        argv += ["--local-addr", LOCAL_HOST]
    if spec.local_addr:  # the user's address wins over meshrun's choice
        argv = _replace_flag(argv, "--local-addr", spec.local_addr)
    argv += spec.torchrun_args
    argv += ["-m", spec.module] if spec.module else [str(spec.script)]
    return argv + list(spec.script_args)


def network_flags(network: NetworkPlan, join_timeout_s: float) -> list[str]:
    """torchrun's flags for this node's part in a multi-node job: its address, and whether
    it hosts the store (``--rdzv-conf``, where the user's own keys win)."""
    conf = {"is_host": str(int(network.is_host)), "join_timeout": str(max(1, int(join_timeout_s)))}
    conf.update(network.user_conf)
    joined = ",".join(f"{k}={v}" for k, v in conf.items())
    return ["--local-addr", network.interface.address, "--rdzv-conf", joined]


def _output_args(spec: LaunchSpec) -> list[str]:
    """torchrun's --tee/--redirects: the user's when given, else a tee of stderr only.

    Worker stdout then goes straight through, byte for byte what torchrun prints, terminal or
    pipe. stderr is copied to RUN_DIR/logs for the failure summary; torchrun's tail prints
    those lines with its "[default0]:" prefix (torchrun offers no tee without one).
    """
    if not spec.tee and not spec.redirects:
        return ["--tee", "2"]
    return [
        *(["--tee", spec.tee] if spec.tee else []),
        *(["--redirects", spec.redirects] if spec.redirects else []),
    ]


def _check_torchrun_fields(spec: LaunchSpec) -> None:
    if spec.rdzv_backend not in ("c10d", "static"):
        raise ValueError(f"rdzv_backend must be c10d or static, got {spec.rdzv_backend!r}")
    if spec.rdzv_backend == "static" and spec.rendezvous.endpoint is None:
        raise ValueError("rdzv_backend static needs rdzv_endpoint (MASTER_ADDR:MASTER_PORT)")
    # A flag meshrun sets itself, given again here, would leave two values for torchrun.
    owned = {o for f in FLAGS if not f.passed for o in f.options} | {"-m", "--module"}
    if clash := owned.intersection(arg.split("=")[0] for arg in spec.torchrun_args):
        raise ValueError(
            f"torchrun_args must not hold {sorted(clash)}: LaunchSpec has a field for each"
        )


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag)
    return [*argv[: i + 1], value, *argv[i + 2 :]]


def rendezvous_endpoint(spec: LaunchSpec, port: int) -> str:
    """The spec's endpoint, or the loopback address with ``port`` for a single node."""
    return spec.rendezvous.endpoint_text or f"{LOCAL_HOST}:{port}"


def launch_local(spec: LaunchSpec) -> int:
    """Run ``spec`` under torchrun's agent; return the exit code, never raise for a worker."""
    with _launch_nonce():
        return _launch(spec)


def _launch(spec: LaunchSpec) -> int:
    rdzv = spec.rendezvous  # parsed once, when the spec was made (launch/spec.py)
    if spec.replica_groups > 1:
        from meshrun.launch.replicas import launch_replica_groups  # its threads: on use

        with orphan_guard(), _claim(spec, rdzv, None):  # agents and workers end with us
            return launch_replica_groups(_group_plan(spec))
    try:
        network = _plan_network(spec, rdzv)
        # A joining node reads the secret once the host's store answers (_checked_handshake).
        secret = _job_secret(spec, network) if network is None or network.is_host else None
    except (NetworkError, SecretError) as err:
        say_error("launch", err)
        return 1
    os.makedirs(spec.log_dir, exist_ok=True)
    # Runs already in the log folder, so the summary reads this run's logs, not theirs.
    known_runs = set(os.listdir(spec.log_dir))
    with _claim(spec, rdzv, network), launch_environment(spec, network, secret) as omp_threads:
        if network is not None:
            argv = build_torchrun_args(spec, 0, network)
            say_line(start_line(spec, 0, omp_threads, network))
            return _run_multinode(argv, spec, network, known_runs, rdzv)
        with _local_store(spec) as port:
            argv = build_torchrun_args(spec, port, network)
            say_line(start_line(spec, port, omp_threads, network))
            return _run_agent(argv, spec, known_runs, None)


@contextmanager
def _launch_nonce() -> Iterator[None]:
    """A nonce for this launch, in the environment the agent (in-process, or a replica
    group's process) reads: the signed rendezvous refuses states of any other launch
    (launch/trust/rendezvous.py). Several nodes replace it with the handshake's attempt token.
    The whole environment is put back afterwards, whichever path the launch took: tests and
    tools launch in-process, one launch after another."""
    with restored_environ():
        os.environ[NONCE_ENV] = secrets.token_hex(8)
        yield


def _claim(
    spec: LaunchSpec, rdzv: Rendezvous, network: NetworkPlan | None
) -> AbstractContextManager[None]:
    """The run directory's lock (launch/rundir.py): one node, or the rendezvous host, takes
    it; the other nodes refuse a directory another job holds. Nested in meshrun launch's own."""
    return claim_run_dir(spec.run_dir, rdzv, network is None or network.is_host)


def _job_secret(spec: LaunchSpec, network: NetworkPlan | None) -> JobSecret:
    """One node, or the node hosting the store: read or create it; the others wait for it
    (a shared run directory) within the join timeout."""
    create = network is None or network.is_host
    wait_s = 0.0 if create else spec.join_timeout_s
    return resolve(spec.run_dir, os.environ, create=create, wait_s=wait_s, say=say_launch)


@contextmanager
def _local_store(spec: LaunchSpec) -> Iterator[int]:
    """One node's rendezvous store, created here on loopback (the agent's ``meshrun``
    rendezvous uses it); yields its port. The static rendezvous keeps torchrun's own."""
    if spec.rdzv_backend != "c10d":
        yield free_port()
        return
    from meshrun.launch.trust.rendezvous import forget_store, listen_store

    store = listen_store(LOCAL_HOST, 0, timeout_s=max(60.0, spec.join_timeout_s))
    publish_attempt(store, spec.rendezvous.rdzv_id, from_env())
    try:
        yield store.port
    finally:
        forget_store(store)


def _group_plan(spec: LaunchSpec) -> GroupPlan:
    """``--replica-groups``: each group a torchrun job of its own (its rendezvous id, port,
    run dir and config), built by :func:`build_torchrun_args` as one job would be."""
    from meshrun.launch.replicas import GroupPlan

    assert spec.config_path, "meshrun launch writes the resolved config first"

    def argv_for(index: int, run_dir: str, config_path: str) -> list[str]:
        group = dataclasses.replace(
            spec,
            procs_per_node=spec.procs_per_node // spec.replica_groups,
            run_dir=run_dir,
            config_path=config_path,
            rendezvous=dataclasses.replace(
                spec.rendezvous, rdzv_id=f"{spec.rendezvous.rdzv_id}-group{index}"
            ),
            replica_groups=0,
        )
        return build_torchrun_args(group, free_port())

    return GroupPlan(
        spec.replica_groups,
        spec.procs_per_node,
        spec.config_path,
        spec.lighthouse,
        argv_for,
        dict(spec.extra_env),
        nodes=spec.rendezvous.nodes.max_nodes,
    )


def _run_multinode(
    argv: list[str],
    spec: LaunchSpec,
    network: NetworkPlan,
    known_runs: set[str],
    rdzv: Rendezvous,
) -> int:
    for warning in network.warnings:
        say_launch(f"warning: {warning}")
    try:
        # The host's store must outlive the agent, which reuses it: hold it until then.
        store = _checked_handshake(spec, network, rdzv.nodes)
    except (HandshakeError, SecretError) as err:
        say_error("launch", err)
        return 1
    except KeyboardInterrupt:
        return _interrupted(signal.SIGINT)
    try:
        return _run_agent(argv, spec, known_runs, network)
    finally:
        from meshrun.launch.trust.rendezvous import forget_store

        forget_store(store)
        del store


def _plan_network(spec: LaunchSpec, rdzv: Rendezvous) -> NetworkPlan | None:
    if not rdzv.multinode:
        return None
    multinode.validate(rdzv)
    return multinode.plan_network(rdzv, spec.interface, os.environ)


def _checked_handshake(spec: LaunchSpec, network: NetworkPlan, target: JoinTarget) -> Any:
    """Open the rendezvous store and check the nodes against each other; return the store."""
    from meshrun.launch.multinode.handshake import open_store

    store = open_store(
        network.rdzv_address,
        network.rdzv_port,
        is_host=network.is_host,
        timeout_s=spec.join_timeout_s,
        say=say_launch,
    )
    if not network.is_host:  # the host wrote it before its store answered; read it now
        os.environ[SECRET_ENV] = _job_secret(spec, network).key.decode()
    rdzv = spec.rendezvous
    info = local_node_info(
        rdzv.node_rank, spec.procs_per_node, spec.config_digest, spec.shared_config
    )
    handshake = Handshake(
        store,
        rdzv.rdzv_id,
        info,
        target,
        network.is_host,
        spec.join_timeout_s,
        say_launch,
        from_env(),
    )
    nodes = handshake.run()
    # Every node's signed rendezvous states carry the host's attempt token: one per launch.
    os.environ[NONCE_ENV] = handshake.attempt
    names = name_list([n.hostname for n in sorted(nodes, key=lambda n: n.node_rank)])
    say_launch(f"{len(nodes)} nodes joined [{names}]; versions and config agree")
    return store


def start_line(
    spec: LaunchSpec, port: int, omp_threads: str, network: NetworkPlan | None = None
) -> str:
    """The one banner line printed before the agent starts."""
    procs = "process" if spec.procs_per_node == 1 else "processes"
    target = spec.rendezvous.nodes
    nnodes = target.text
    nodes = "node" if (target.min_nodes, target.max_nodes) == (1, 1) else "nodes"
    parts = [
        f"meshrun launch: {spec.procs_per_node} {procs} x {nnodes} {nodes}",
        f"rendezvous {'static ' if spec.rdzv_backend == 'static' else ''}"
        f"{rendezvous_endpoint(spec, port)}",
    ]
    if network is not None:
        role = "hosts the rendezvous store" if network.is_host else "joins the rendezvous"
        parts.append(
            f"interface {network.interface}, route to {network.rdzv_address}, this node {role}"
        )
    parts.append(f"OMP_NUM_THREADS={omp_threads}")
    if spec.config_path:
        parts.append(f"config {spec.config_path}")
    parts.append(f"logs {spec.log_dir}")
    return " | ".join(parts)


def _validate(spec: LaunchSpec) -> None:
    if (spec.script is None) == (spec.module is None):
        raise ValueError(
            f"LaunchSpec needs exactly one of script or module, got "
            f"script={spec.script!r}, module={spec.module!r}"
        )
    # The config's 0 (= auto) must have been resolved to a count before the spec was made.
    if spec.procs_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {spec.procs_per_node}")


def _run_agent(
    argv: list[str], spec: LaunchSpec, known_runs: set[str], network: NetworkPlan | None
) -> int:
    # Imported here so that building argv (and `meshrun --help`) does not load the agent.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from meshrun.launch.agent.watch import RDZV_GRACE_S, watched_agent
    from meshrun.launch.trust.rendezvous import signed_backend_argv

    started = time.time()  # hang files older than this are from an earlier run
    stop_watch = threading.Event()
    threading.Thread(
        target=watch_for_hangs, args=(spec.run_dir, started, stop_watch), daemon=True
    ).start()
    # Only across nodes can the store become unreachable; one node's store is in-process.
    bound = None if network is None else spec.join_timeout_s + RDZV_GRACE_S
    hint = "" if network is None else f" at {network.rdzv_address}:{network.rdzv_port}"
    try:
        with watched_agent(spec.max_restarts, bound, say_launch, hint):
            run(get_args_parser().parse_args(signed_backend_argv(argv)))
    except ChildFailedError as err:
        return _report_failure(err.failures, spec, known_runs, started)
    except SignalException as err:
        # The agent caught the signal and has already stopped the workers.
        return _interrupted(signal.Signals(err.sigval))
    except KeyboardInterrupt:
        return _interrupted(signal.SIGINT)
    except Exception as err:  # the agent itself failed: rendezvous timeout, bad endpoint...
        say_line(_agent_failed(err, network is not None))
        return 1
    finally:
        stop_watch.set()
    return 0


def _report_failure(
    failures: Mapping[int, Any], spec: LaunchSpec, known_runs: set[str], started: float
) -> int:
    # Read only when a run failed: a launch that succeeds never imports the summary.
    from meshrun.launch.agent.failures import HangStates, find_attempt_dir, summarize_failures

    attempt_dir = find_attempt_dir(spec.log_dir, spec.rendezvous.rdzv_id, known_runs)
    ended, waiting = hang_states(spec.run_dir, started)
    states = HangStates(ended=ended, waiting=waiting)
    report = summarize_failures(failures, attempt_dir, socket.gethostname(), states)
    say_line(report.text)
    hang = hang_report(spec.run_dir, started)
    if hang is not None:  # the watchdog's stacks: who did not report, where the others wait
        say_line(hang)
    return report.exit_code


def _agent_failed(err: BaseException, multinode: bool) -> str:
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    if multinode and isinstance(err, RendezvousError):  # the other nodes' store went away
        return f"meshrun launch: lost the rendezvous: {one_line(err)}"
    return f"meshrun launch: the torchrun agent failed: {one_line(err)}"


def _interrupted(sig: signal.Signals) -> int:
    say_line(f"meshrun launch: stopped by {sig.name}; workers shut down")
    return EXIT_INTERRUPTED if sig == signal.SIGINT else 128 + int(sig)
