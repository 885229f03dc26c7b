"""Putting the application on Ray Serve on the Ray just joined, and why that can fail: no plan fits an alpa/ model
on the cluster, someone else's Serve or application is in the way there, or Serve refuses the application (with what
it says of the deployments that failed).
"""
from __future__ import annotations

import argparse
import asyncio
import threading

from opt_serving import startlog
from opt_serving.parallel.planner import NoFeasiblePlan
from opt_serving.service.deployment import build_app
from opt_serving.service.ports import free_port

APP_NAME = "opt"


def deploy(args: argparse.Namespace, serve_args, direct: bool, started_ray: bool) -> tuple[str | None, str | None]:
    """Start Serve on the Ray just joined and run the application on it -> (the name of the application
    deployed, None) or (None, why not): the planner finds no plan that fits an alpa/ model on the cluster, or
    a cluster this command did not start already runs Serve elsewhere than --port or an application of our
    name (never replaced), or Serve refuses the application."""
    from ray import serve  # after Ray started: Serve reads its settings when imported

    # with direct ingress Serve still starts its proxy: it gets a spare port, the replica owns --port
    with startlog.PHASES.phase("Serve start"):
        serve.start(http_options={"host": args.host, "port": free_port() if direct else args.port})
    if not started_ray:
        problem = _foreign_serve_problem(args)
        if problem:
            return None, problem
    try:
        app = build_app(serve_args)  # plans alpa/ models for the cluster just joined
    except NoFeasiblePlan as e:
        return None, str(e)
    try:
        with startlog.PHASES.phase("application deployed (the replica's start)"):
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except Exception as e:  # e.g. another application holds the route prefix "/", or a replica failed to start
        return None, (f"Ray Serve on the cluster at {_cluster_address()} refused the application: {e}"
                      + deployment_messages(APP_NAME))
    return APP_NAME, None


def deployment_messages(name: str) -> str:
    """What Serve says of the application's deployments that are not running (a replica's constructor's error,
    with its traceback), to print beside Serve's one-line refusal; "" where it says nothing more."""
    from ray import serve
    try:
        app = serve.status().applications.get(name)
    except Exception:  # the controller gone with the failure: the refusal is all there is
        return ""
    if app is None:
        return ""
    said = [f"{d}: {s.message}" for d, s in app.deployments.items() if s.message and s.status != "HEALTHY"]
    return "".join(f"\n  {m}" for m in said)


def _cluster_address() -> str:
    import ray
    return ray.get_runtime_context().gcs_address


def _foreign_serve_problem(args: argparse.Namespace) -> str | None:
    """On a cluster this command did not start: why it cannot serve there (None: it can). Serve keeps the HTTP
    settings it first started with, so a Serve already running on another port would leave --port
    unanswered; an application of our name there is someone else's."""
    from ray import serve
    from ray.serve.context import _get_global_client
    where, http = _cluster_address(), _get_global_client().http_config
    if http.port != args.port or http.host != args.host:
        return (f"Ray Serve already runs on the Ray cluster at {where}, its HTTP proxy on {http.host}:{http.port}, "
                f"and keeps that: this command cannot serve on {args.host}:{args.port} there. Use --host "
                f"{http.host} --port {http.port} to serve beside its applications, or --ray-address local for a "
                "Ray of this command's own")
    if APP_NAME in serve.status().applications:
        return (f"the Ray cluster at {where} already runs a Serve application named '{APP_NAME}' that this "
                "command did not deploy: it is left as it is. Stop it there (`serve shutdown`, or the program "
                "that deployed it), or use --ray-address local for a Ray of this command's own")
    return None


def replica_phases() -> list[str]:
    """Where the application's replica's start went (its startlog lines), or [] where it cannot say (the fake
    engine's replica says the same way; a replica of another version has no such method)."""
    from ray.serve.handle import DeploymentHandle

    async def fetch():  # a handle of this call's own (not serve.get_deployment_handle's cached one), shut down here
        handle = DeploymentHandle("OPTServer", APP_NAME)
        try:
            return await handle.start_phases.remote()
        finally:
            await handle.shutdown_async()

    call = asyncio.run_coroutine_threadsafe(fetch(), _handle_loop())
    try:
        return startlog.lines_of(call.result(timeout=30))
    except Exception as e:  # a log line is not worth failing a start for
        call.cancel()  # (a replica silent for 30 s: the call given up, its handle shut down)
        return [f"opt-serving start: the replica's phases are not known ({type(e).__name__}: {e})"]


_loop: asyncio.AbstractEventLoop | None = None


def _handle_loop() -> asyncio.AbstractEventLoop:
    """The event loop of this command's calls through Serve handles, running in a thread of its own until the
    command exits. In Serve's throughput-optimised mode a handle's router and Serve's long-poll client run on
    the caller's loop; a loop closed after the call (asyncio.run) left them bound to it, so serve.shutdown()
    failed on the router ("Event loop is closed", skipping the ray.shutdown() after it) and the long-poll
    clients logged errors as Serve stopped."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        threading.Thread(target=_loop.run_forever, daemon=True, name="opt-serving-handles").start()
    return _loop
