"""The `meshserve` command.

It imports a service's module only for the service it runs (`meshserve serve ROLE`): a worker's
module loads torch, and `meshserve up` (the launcher) and the gateway, scheduler and kv-pool
processes it starts do no tensor math, so they never load it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from meshserve.cli.errors import USER_ERRORS, ArgumentParser, fail
from meshserve.shared.manifest import add_models_argument
from meshserve.shared.models_repo import DEFAULT_MODEL


def _models(args) -> int:
    from meshserve.shared import models_repo

    if args.action == "pull":
        print(models_repo.pull(args.name))
    else:
        for name in models_repo.KNOWN_MODELS:
            path = models_repo.cached_path(name)
            print(f"{name}\t{path if path else '(not pulled)'}")
    return 0


def _nats_credentials(args) -> int:
    from pathlib import Path

    from meshserve.shared import nats_auth

    passwords = nats_auth.generate_passwords(workers=args.workers)
    nats_auth.write_credentials(Path(args.dir), passwords)
    # the server's block for these users, passwords from its environment: with the default two workers,
    # deploy/nats.conf's block (tests/test_deploy.py keeps them equal)
    block = nats_auth.authorization_block("meshserve", {u: "$" + nats_auth.password_env(u) for u in passwords})
    nats_auth.write_private(Path(args.dir) / nats_auth.AUTHORIZATION_CONF, block)
    print(f"NATS credentials written to {args.dir}: " + ", ".join(f"{u}.env" for u in passwords)
          + f", {nats_auth.SERVER_ENV}, {nats_auth.AUTHORIZATION_CONF}")
    return 0


ROLES = ("gateway", "scheduler", "prefill", "decode", "kv-pool", "model-loader")
# They take --models (the model manifest); the kv-pool for the models' memory quotas, the workers for
# their compute partitions (each worker's --model names the model it starts on).
MANIFEST_ROLES = ("gateway", "scheduler", "model-loader", "kv-pool", "prefill", "decode")
WORKER_ROLES = ("prefill", "decode")


def _common(p: argparse.ArgumentParser, nats_default: str | None = "nats://127.0.0.1:4222") -> None:
    p.add_argument("--nats-url", default=os.environ.get("MESHSERVE_NATS_URL", nats_default))
    p.add_argument("--namespace", default=os.environ.get("MESHSERVE_NAMESPACE", "meshserve"),
                   help="prefix of every NATS subject")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, HF directory or .gguf file")
    p.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--node-id", default=os.environ.get("MESHSERVE_NODE_ID", "node0"),
                   help="processes with one node id share memory (KV arena, weights)")


def _serve(args) -> int:
    import asyncio

    import uvloop

    role = args.role
    if role == "gateway":
        from meshserve.services.gateway.main import run as entry
    elif role == "scheduler":
        from meshserve.services.scheduler.main import main as entry
    elif role == "kv-pool":
        from meshserve.services.kv_pool.main import main as entry
    elif role == "model-loader":
        from meshserve.services.model_loader.main import main as entry
    else:
        from meshserve.services.worker.main import main as worker_main

        def entry(a):
            return worker_main(a, role)
    uvloop.install()
    asyncio.run(entry(args))
    # Stopped and cleaned up (the service's own files removed, the bus drained): leave without the
    # interpreter's teardown, which in a process that loaded torch takes seconds (2.5 s for a worker
    # on an idle machine), all of it added to the stop of a mesh.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _add_role_arguments(role: str, p: argparse.ArgumentParser) -> None:
    if role == "gateway":
        from meshserve.services.gateway.main import add_arguments
    elif role == "scheduler":
        from meshserve.services.scheduler.main import add_arguments
    elif role == "kv-pool":
        from meshserve.services.kv_pool.main import add_arguments
    elif role == "model-loader":
        from meshserve.services.model_loader.main import add_arguments
    else:
        from meshserve.services.worker.main import add_arguments
    add_arguments(p)


def roles_for(argv: list[str] | None) -> tuple[str, ...]:
    """The roles whose options the parser needs for `argv` (None: all of them)."""
    if argv is None:
        return ROLES
    if len(argv) >= 2 and argv[0] == "serve" and argv[1] in ROLES:
        return (argv[1],)
    return ()


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the `argv` about to be parsed, only the options of the role it
    serves are added (importing a service's module is what they cost)."""
    with_options = roles_for(argv)
    p = ArgumentParser(prog="meshserve", description="An LLM inference mesh over NATS.")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("batch", help="run an OpenAI Batch JSONL file through the in-process engine, or with --url "
                                     "through a running mesh")
    b.add_argument("-i", "--input", required=True, help="input JSONL ('-' for stdin)")
    b.add_argument("-o", "--output", required=True, help="output JSONL ('-' for stdout)")
    b.add_argument("--url", default=None, help="send the lines to this running server (http://HOST:PORT) as the "
                                              "background class, instead of running the engine here")
    b.add_argument("--api-key", default=os.environ.get("MESHSERVE_API_KEY"),
                   help="with --url: the tenant's API key (default: $MESHSERVE_API_KEY)")
    b.add_argument("--concurrency", type=int, default=8, help="with --url: lines in flight at once (default: 8)")
    b.add_argument("--max-retries", type=int, default=5,
                   help="with --url: retries of a line answered 429 or 503, after its Retry-After (default: 5)")
    b.add_argument("--model", default=DEFAULT_MODEL, help="model name, HF directory or .gguf file")
    b.add_argument("--served-model-name", default=None, help="name in the responses (default: --model)")
    b.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    from meshserve.cli.launcher import (DEVICE_ROLES, KV_ROLES, MODEL_ROLES, add_device_argument,
                                        add_kv_cache_dtype_argument, add_quantization_argument)
    add_quantization_argument(b)
    from meshserve.shared.reasoning import add_reasoning_argument
    from meshserve.shared.tool_calls import add_tool_call_parser_argument
    add_reasoning_argument(b)
    add_tool_call_parser_argument(b)
    b.set_defaults(func=lambda a: __import__("meshserve.cli.batch", fromlist=["main"]).main(a))

    up = sub.add_parser("up", help="start the whole mesh on this machine (its own nats-server too)")
    _common(up, nats_default=None)
    add_models_argument(up)
    from meshserve.cli.launcher import add_arguments as up_arguments
    up_arguments(up)
    up.set_defaults(func=lambda a: __import__("meshserve.cli.launcher", fromlist=["run"]).run(a))

    serve = sub.add_parser("serve", help="run one service of the mesh")
    roles = serve.add_subparsers(dest="role", required=True)
    for role in ROLES:
        rp = roles.add_parser(role, help=f"the {role} service", conflict_handler="resolve")
        _common(rp)
        if role in DEVICE_ROLES:
            add_device_argument(rp)
        if role in MODEL_ROLES:
            add_quantization_argument(rp)
        if role in MANIFEST_ROLES:
            add_models_argument(rp)
        if role in KV_ROLES:
            add_kv_cache_dtype_argument(rp)
        if role in with_options:
            _add_role_arguments(role, rp)
        rp.set_defaults(func=_serve)

    nc = sub.add_parser("nats-credentials", help="generate NATS users and passwords for compose/Kubernetes "
                                                  "(docs/security.md): DIR/<user>.env and DIR/nats-server.env, 0600")
    nc.add_argument("dir", help="where to write them (deploy/credentials for compose.yaml and deploy/)")
    nc.add_argument("--workers", type=int, default=2,
                    help="a user of its own for each of this many workers, worker-0.env ... (default: %(default)s, "
                         "the prefill (worker-0) and decode (worker-1) of compose.yaml and deploy/; more: "
                         "docs/security.md)")
    nc.set_defaults(func=_nats_credentials)

    m = sub.add_parser("models", help="the local model repository")
    m.add_argument("action", choices=["pull", "list"])
    m.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    m.set_defaults(func=_models)

    bench = sub.add_parser("bench-engine", add_help=False,
                           help="the engine benchmark: meshserve vs Transformers, side by side")
    bench.set_defaults(func=lambda a: __import__("meshserve.bench.engine_bench",
                                                 fromlist=["main"]).main(a.rest), passthrough=True)
    bm = sub.add_parser("bench-mesh", add_help=False,
                        help="the mesh benchmark: meshserve up vs the in-process engine, side by side")
    bm.set_defaults(func=lambda a: __import__("meshserve.bench.mesh_bench",
                                              fromlist=["main"]).main(a.rest), passthrough=True)
    bs = sub.add_parser("bench-startup", add_help=False,
                        help="time `meshserve up` to its first served token (cold and warm) and the memory "
                             "of each of its processes")
    bs.set_defaults(func=lambda a: __import__("meshserve.bench.startup_bench",
                                              fromlist=["main"]).main(a.rest), passthrough=True)
    # Measurement commands (issue 4); each module parses its own options.
    for name, module, text in (
            ("bench", "bench.loadgen", "load-test an OpenAI-compatible server or the NATS API with a workload"),
            ("analyze", "bench.analyze", "summarize and plot a gateway request log"),
            ("analyze-traces", "bench.ttft_breakdown", "where each request's time to first token went, from a "
                                                       "mesh's MESHSERVE_TRACE_FILE spans"),
            ("plan", "bench.plan", "size prefill and decode workers for a workload, a rate and SLOs"),
            ("compare", "bench.compare", "one workload against the mesh, the engine, Transformers, llama.cpp"),
            ("bench-roles", "bench.roles_bench", "elastic prefill/decode roles against fixed splits"),
            ("bench-sched", "bench.sched_bench", "scheduling: priority vs fcfs, interactive TTFT under a batch, "
                                                 "swap vs recompute"),
            ("bench-soak", "bench.soak_bench", "minutes of load with a fault every few minutes: nothing lost"),
            ("bench-busy", "bench.busy_bench", "one stream's speed beside a CPU burner: fixed threads vs tuned"),
            ("bench-models", "bench.models_bench", "many models on one mesh: a weights budget against every model "
                                                   "resident and a one-model server restarted per switch (hit rate, "
                                                   "loads, evictions, TTFT per model)"),
            ("bench-reload", "bench.reload_bench", "a model added by a manifest reload beside a busy model of another "
                                                   "KV shape: KV arenas resized in place against sized once"),
            ("bench-isolation", "bench.isolation_bench", "a small model's TTFT and inter-token latency alone, beside a "
                                                         "busy larger model, and beside it with partitions (cpus)"),
            ("bench-tenants", "bench.tenants_bench", "one tenant's latency while another floods its class, with the "
                                                     "scheduler's fair share between tenants and without"),
            ("bench-spec", "bench.spec_bench", "speculative decoding: batch-1 decode with and without prompt "
                                               "lookup, bf16 and int8, copy and chat workloads"),
            ("bench-quant", "bench.quant_bench", "int8 weights and int8 KV cache against bf16: decode speed and "
                                                 "perplexity")):
        sp = sub.add_parser(name, add_help=False, help=text)
        sp.set_defaults(func=lambda a, m=module: __import__(f"meshserve.{m}", fromlist=["main"]).main(a.rest),
                        passthrough=True)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        args.rest = rest  # the subcommand parses its own options
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    prog = " ".join(filter(None, ("meshserve", args.command, getattr(args, "role", None))))
    if getattr(args, "tenants", None):  # a bad tenants file: one line, before anything starts
        from meshserve.shared.tenants import TenantsFileError, load_tenants

        try:
            load_tenants(args.tenants)
        except TenantsFileError as e:
            return fail(prog, f"--tenants: {e}")
    if getattr(args, "models", None):  # a bad manifest: one line, before anything starts
        from meshserve.shared.manifest import ManifestError, load_manifest

        try:
            first = load_manifest(args.models).models[0]
        except ManifestError as e:
            return fail(prog, f"--models: {e}")
        args.models = str(Path(args.models).expanduser().resolve())
        if getattr(args, "role", None) not in WORKER_ROLES:
            args.model, args.served_model_name = first.path, first.name  # what --model-only parts use
    if getattr(args, "device", "cpu") == "cuda":  # before any process, connection or allocation: fail fast
        from meshserve.shared.node_memory import cuda_problem

        problem = cuda_problem()
        if problem:
            return fail(prog, f"--device cuda: {problem}")
    try:
        serves_here = args.command in ("up", "serve") or (args.command == "batch" and not args.url)
        if serves_here:  # an unknown model, before anything starts (batch --url names a served model)
            from meshserve.shared.models_repo import check, model_config

            check(args.model)
            if not getattr(args, "models", None):  # a model this decoder does not run: refused in one line
                try:
                    model_config(args.model, download=False)
                except FileNotFoundError:
                    pass  # a known model not pulled yet, or files the loader will say more about
                except ValueError as e:
                    return fail(prog, f"--model {args.model}: {e}")
        return args.func(args) or 0
    except USER_ERRORS as e:  # a mistake in what the command was given: one line, never a traceback
        return fail(prog, e)


if __name__ == "__main__":
    sys.exit(main())
