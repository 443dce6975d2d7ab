"""Who may connect to the mesh's NATS and what each may publish and subscribe to: one user per
service, a `public` user for the public NATS API and an `admin` user for operators, defined once
here; `meshserve up` renders them into its nats-server's config and deploy/nats.conf carries the
same block for namespace "meshserve" (tests/test_deploy.py keeps them equal).

A process gets its credentials from the environment (never its command line, which `ps` shows):
MESHSERVE_NATS_USER, MESHSERVE_NATS_PASSWORD and MESHSERVE_NATS_INBOX (its reply-subject prefix:
each service user has its own, so no other user can read the replies to its requests), plus
MESHSERVE_NATS_TLS_CA/_CERT/_KEY for TLS. Credentials in the URL (nats://user:pw@host) work too.

Each worker may have a user of its own (`worker-<i>`, which `meshserve up` makes for each of its
workers, and compose/Kubernetes give their prefill and decode; `worker` is shared by any worker
started without one): a worker's id starts with its user's name (`<name>.<role>-<node>-<pid>`,
shared/subjects.py), so its user may subscribe to its own `worker.<name>.*.<verb>` subjects and no
other worker's, whatever pid a restart gives it.

The rules (docs/security.md): workers cannot publish on the public API nor on scheduler.submit
(they do publish and hear each other's compute claims, `compute.*.claim`);
only the kv-pool subscribes to (answers) kv subjects, other services hear only its broadcasts
(hello, pressure, host_events) and the scheduler the KV events; the public user may only send
requests on `<ns>.v1.*` and read replies on _INBOX; a connection without credentials is refused.
"""

from __future__ import annotations

import os
import secrets
import ssl
import stat
from pathlib import Path
from urllib.parse import urlsplit

from .subjects import Subjects

ENV_USER, ENV_PASSWORD, ENV_INBOX = "MESHSERVE_NATS_USER", "MESHSERVE_NATS_PASSWORD", "MESHSERVE_NATS_INBOX"
ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY = "MESHSERVE_NATS_TLS_CA", "MESHSERVE_NATS_TLS_CERT", "MESHSERVE_NATS_TLS_KEY"

WORKER = "worker"  # the worker user shared by every worker that has none of its own
SERVICE_USERS = ("gateway", "scheduler", "model-loader", "kv-pool", WORKER)
PUBLIC, ADMIN = "public", "admin"
USERS = (*SERVICE_USERS, PUBLIC, ADMIN)
PUBLIC_INBOX = "_INBOX"
# How long a responder may still answer a request it received: nats' default (2 min) is shorter
# than a model-loader's first load of a large model.
RESPONSE_EXPIRES = "1h"  # nats clients' default reply prefix: what a public client uses

# `meshserve serve ROLE` -> the user it connects as
ROLE_USER = {"gateway": "gateway", "scheduler": "scheduler", "model-loader": "model-loader",
             "kv-pool": "kv-pool", "prefill": "worker", "decode": "worker"}


WORKER_VERBS = ("prefill", "adopt", "abort", "role", "model")  # what the scheduler sends one worker


def worker_user(i: int) -> str:
    """The user of a launcher's i-th worker (its own credentials and subjects)."""
    return f"{WORKER}-{i}"


def worker_name(env=None, url: str | None = None) -> str:
    """The first part of a worker's id: its NATS user (from the environment, else the URL), whose
    permissions name this worker's subjects; `worker` for a worker connecting without one."""
    env = os.environ if env is None else env
    return env.get(ENV_USER) or (urlsplit(url).username if url else None) or WORKER


def inbox(user: str) -> str:
    """A service user's own reply-subject prefix (one subject token)."""
    return PUBLIC_INBOX if user in (PUBLIC, ADMIN) else f"_INBOX_{user}"


def permissions(namespace: str, workers: tuple[str, ...] = ()) -> dict[str, dict]:
    """Each user's {"publish": [...], "subscribe": [...], "allow_responses": bool}; admin: none
    (everything); `workers`: the per-worker users besides the shared `worker`. A request's reply goes
    to the requester's inbox: a responder may publish there through allow_responses (one reply per
    request: answers and acknowledgements, Bus.ack); the gateway streams many chunks to a public
    client's reply subject, so it may publish on _INBOX.>."""
    s = Subjects(namespace)
    ns = namespace
    kv = lambda verb: s.kv(verb, "*")  # noqa: E731 - every node's subject
    own = lambda user: f"{inbox(user)}.>"  # noqa: E731
    perms = {
        "gateway": {
            "publish": [s.submit, s.abort, s.usage, s.scheduler_status, s.scheduler("reload"), f"{PUBLIC_INBOX}.>"],
            "subscribe": [s.completions, s.chat_completions, s.tokens("*"), s.scheduler_hello, own("gateway")],
            "allow_responses": False},
        "scheduler": {
            "publish": [*(s.worker("*.*", v) for v in WORKER_VERBS), kv("release"),  # every worker's (two tokens)
                        kv("transfer"), kv("status"), *(s.models(v, "*") for v in ("status", "reload", "prewarm")),
                        s.tokens("*"), s.scheduler_hello],
            "subscribe": [*(s.scheduler(e) for e in ("submit", "handoff", "done", "abort", "status", "usage", "reload")),
                          s.heartbeat, kv("events"), own("scheduler")],
            "allow_responses": True},
        "kv-pool": {
            "publish": [f"{ns}.kv.>", s.models("load", "*")],
            "subscribe": [f"{ns}.kv.>", s.heartbeat, own("kv-pool")],
            "allow_responses": True},
        "model-loader": {
            "publish": [],
            # heartbeats: which workers are alive, so a model a live worker maps is never evicted
            "subscribe": [*(s.models(v, "*") for v in ("load", "list", "status", "reload", "prewarm")), s.heartbeat,
                          own("model-loader")],
            "allow_responses": True},
        PUBLIC: {
            "publish": [s.completions, s.chat_completions],
            "subscribe": [f"{PUBLIC_INBOX}.>"],
            "allow_responses": False},
    }
    for user in (WORKER, *workers):
        perms[user] = {  # its own worker.<user>.*.<verb> subjects, whichever incarnation (pid) it is
            "publish": [s.tokens("*"), s.handoff, s.done, s.heartbeat, s.models("load", "*"),
                        *(kv(v) for v in ("arena", "lease", "release", "retain", "events", "swap", "import")),
                        s.compute("claim", "*")],  # its compute claims, to the other workers of its node
            "subscribe": [*(s.worker(f"{user}.*", v) for v in WORKER_VERBS), s.abort,
                          *(kv(v) for v in ("hello", "pressure", "host_events", "retired", "resized")),
                          s.compute("claim", "*"),
                          own(user)],
            "allow_responses": True}  # it acknowledges the scheduler's deliveries (Bus.ack), answers model switches
    return perms


def _quoted(items: list[str]) -> str:
    return "[" + ", ".join(f'"{x}"' for x in items) + "]"


def authorization_block(namespace: str, passwords: dict[str, str], indent: str = "") -> str:
    """nats-server's `authorization { users = [...] }` for these passwords. A password that starts
    with `$` is left unquoted: the server reads it from its environment (deploy/nats.conf)."""
    workers = tuple(u for u in passwords if u not in USERS)
    perms = permissions(namespace, workers)
    lines = ["authorization {", "  users = ["]
    for user in (*USERS, *workers):
        pw = passwords[user]
        pw = pw if pw.startswith("$") else f'"{pw}"'
        entry = f'    {{user: "{user}", password: {pw}'
        if user in perms:
            p = perms[user]
            rules = [f"subscribe: {{allow: {_quoted(p['subscribe'])}}}"]
            if p["publish"]:  # none at all: allow_responses alone leaves only the replies
                rules.insert(0, f"publish: {{allow: {_quoted(p['publish'])}}}")
            entry += ",\n      permissions: {\n        " + ",\n        ".join(rules)
            if p["allow_responses"]:
                entry += f',\n        allow_responses: {{max: 1, expires: "{RESPONSE_EXPIRES}"}}'
            entry += "\n      }"
        lines.append(entry + "}")
    lines += ["  ]", "}"]
    return "\n".join(indent + line if line else line for line in lines) + "\n"


def password_env(user: str) -> str:
    """The environment variable deploy/nats.conf reads a user's password from."""
    return f"NATS_{user.upper().replace('-', '_')}_PASSWORD"


def generate_passwords(workers: int = 0) -> dict[str, str]:
    """A fresh password for every user, and for `workers` per-worker users (worker-0, worker-1, ...).
    Letters first, then hex digits: nats-server reads a `$VAR` whose value starts with a digit as a
    number or a size ("5s...": "Expected a digit"), and one starting with '-' as something else, so a
    token_urlsafe password broke the config about one time in ten (4 of 40 sets)."""
    return {user: "mk" + secrets.token_hex(24) for user in (*USERS, *(worker_user(i) for i in range(workers)))}


def env_for(user: str, password: str) -> dict[str, str]:
    """What a process needs in its environment to connect as `user`."""
    return {ENV_USER: user, ENV_PASSWORD: password, ENV_INBOX: inbox(user)}


def write_private(path: Path, text: str) -> None:
    """A file only its owner may read (0600), created so from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)


SERVER_ENV = "nats-server.env"  # every password as NATS_<USER>_PASSWORD: what deploy/nats.conf reads
AUTHORIZATION_CONF = "nats-authorization.conf"  # `meshserve nats-credentials`: the server's block for its users


def write_credentials(directory: Path, passwords: dict[str, str]) -> None:
    """One env file per user, DIR/<user>.env (MESHSERVE_NATS_USER=... lines), and DIR/nats-server.env
    with every password for a server configured by deploy/nats.conf: what Compose's env_file,
    kustomize's secretGenerator and `set -a; . DIR/public.env` read."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for user, pw in passwords.items():
        write_private(directory / f"{user}.env", "".join(f"{k}={v}\n" for k, v in env_for(user, pw).items()))
    write_private(directory / SERVER_ENV, "".join(f"{password_env(u)}={pw}\n" for u, pw in passwords.items()))


def read_credentials(path: Path) -> dict[str, str]:
    """A DIR/<user>.env file as environment variables."""
    out = {}
    for line in Path(path).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def connect_options(env=None) -> dict:
    """nats.connect() keyword arguments from the environment: user, password, inbox, TLS."""
    env = os.environ if env is None else env
    opts: dict = {}
    if env.get(ENV_USER):
        opts["user"], opts["password"] = env[ENV_USER], env.get(ENV_PASSWORD, "")
    if env.get(ENV_INBOX):
        opts["inbox_prefix"] = env[ENV_INBOX]
    ca, cert, key = env.get(ENV_TLS_CA), env.get(ENV_TLS_CERT), env.get(ENV_TLS_KEY)
    if ca or cert:
        ctx = ssl.create_default_context(cafile=ca or None)
        if cert:
            ctx.load_cert_chain(cert, key or None)
        opts["tls"] = ctx
    return opts
