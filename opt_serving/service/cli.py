"""`opt-serving serve`: run the HTTP service on Ray Serve, starting Ray locally if none is running.

Ctrl-C or SIGTERM: Serve stops taking requests, lets in-flight ones finish for up to
--drain-timeout seconds (then fails them), and the Ray processes this command started are stopped, so
nothing is left behind (metaseq's server needed `killall python`).

Its flags are cli_args.py's, the Ray it runs on ray_session.py's, putting the application on Serve
serve_deploy.py's; this module is the command's course from the command line to the shutdown.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

from opt_serving import startlog
from opt_serving.parallel import ray_address
from opt_serving.service.cli_args import add_arguments, command_line_problem, serve_args_from
from opt_serving.service.ports import port_holder
from opt_serving.service.ray_session import (local_ray_env, lower_ray_priority, start_ray, stop_serving,
                                             wants_direct_ingress)
from opt_serving.service.serve_deploy import deploy, replica_phases

__all__ = ["add_arguments", "run"]  # what opt_serving/cli.py asks of a subcommand's module


@dataclasses.dataclass
class _Started:
    """What this command started, for the shutdown to stop: a Ray of its own, the application it deployed."""
    ray: bool = False
    app: str | None = None


def run(args: argparse.Namespace) -> int:
    startlog.PHASES.since_process_start("imports (process start to the command)")
    serve_args = serve_args_from(args)
    found, problem = _cluster_to_use(args, serve_args)
    if problem:
        print(f"opt-serving serve: {problem}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}

    def take_signals() -> None:
        # Ctrl-C / SIGTERM only set `stop`; the shutdown below runs in the main thread. Taken again after
        # ray.init, which installs a SIGTERM handler that exits without stopping the processes it started.
        for s in signals:
            signal.signal(s, lambda *_: stop.set())

    take_signals()
    started, code = _Started(), 1
    try:
        code = _serve(args, serve_args, found, started, stop, take_signals)
        return code
    finally:
        _shut_down(args, started, previous, code)


def _cluster_to_use(args: argparse.Namespace, serve_args):
    """-> (ray_address.find_cluster's pick, None), or (None, what is wrong with the command line or the cluster
    to use), found before Ray starts."""
    problem = command_line_problem(args, serve_args)
    if problem:
        return None, problem
    try:
        found = ray_address.find_cluster(args.ray_address)
    except ConnectionError as e:
        return None, str(e)
    if found.address is None:  # a Ray of our own will serve on --port: it must be free
        holder = port_holder(args.host, args.port)
        if holder:
            return None, f"--port {args.port} on {args.host} is taken by {holder}; stop that, or choose another --port"
    return found, None


def _serve(args: argparse.Namespace, serve_args, found, started: _Started, stop: threading.Event,
           take_signals) -> int:
    """Join or start Ray, deploy the application, and serve until `stop` is set -> the exit code. What it
    starts is written into `started` as it goes, for the shutdown."""
    direct = wants_direct_ingress(args.ingress, args.num_replicas)
    with startlog.PHASES.phase("Ray start"):
        started.ray = start_ray(found, args.num_cpus, local_ray_env(args, direct))
    take_signals()
    if stop.is_set():
        return 130
    if direct and not started.ray:  # a cluster started elsewhere keeps its own Serve settings
        if args.ingress == "direct":
            print("opt-serving serve: --ingress direct needs a Ray started by this command "
                  "(--ray-address local)", file=sys.stderr)
            return 2
        direct = False
    started.app, problem = deploy(args, serve_args, direct, started.ray)
    if problem:
        print(f"opt-serving serve: {problem}", file=sys.stderr)
        return 2
    take_signals()
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    with startlog.PHASES.phase("HTTP answers"):
        answers = _answers(f"http://{host}:{args.port}/health", timeout_s=60)
    if not answers:
        print(f"opt-serving serve: the application is running but nothing answers at http://{host}:"
              f"{args.port}/ ({'its replica' if direct else 'Serve proxy'} did not bind it); stopping",
              file=sys.stderr)
        return 1
    if started.ray:  # the replicas are up: every other process Ray started is running by now
        lower_ray_priority(args.ray_nice, include_proxy=direct)
    _print_start()
    print(_banner(args, serve_args, direct), flush=True)
    stop.wait()
    print("opt-serving: shutting down (draining in-flight requests)", file=sys.stderr, flush=True)
    return 0


def _print_start() -> None:
    """Where the start went: this command's phases, then the replica's (startlog.py), to stderr."""
    lines = startlog.PHASES.lines() + ["  " + line for line in replica_phases()]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _shut_down(args: argparse.Namespace, started: _Started, previous: dict, code: int) -> None:
    """Stop what the command started, the signal handlers it replaced given back after."""
    # second Ctrl-C while draining should not leave a half-stopped cluster: ignore it
    for s in previous:
        signal.signal(s, signal.SIG_IGN)
    try:
        finished = stop_serving(started.ray, started.app, timeout_s=args.drain_timeout + 30)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if not finished:  # Ray's own exit handlers would wait on the same gone cluster
        print("opt-serving: stopping did not finish in time; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)


def _answers(url: str, timeout_s: float) -> bool:
    """Whether an HTTP server answers at `url` (any status) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).close()
            return True
        except urllib.error.HTTPError:  # an answer, if not a 200 (a health check failing, an API key)
            return True
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.5)


def _banner(args: argparse.Namespace, serve_args, direct: bool) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    what = "the fake engine" if serve_args.engine == "fake" else (
        (serve_args.model or "the embedded tiny model") + (" (random weights)" if serve_args.dummy else ""))
    return (f"opt-serving: serving {what} at http://{host}:{args.port}/ "
            f"(OpenAI base_url http://{host}:{args.port}/v1; {'direct ingress' if direct else 'Serve proxy'}); "
            "Ctrl-C to stop")
