"""The gateway: the mesh's only client-facing service (OpenAI API over HTTP and over NATS).

Entry points: main.run(args) (async), main.main(args) (sync, uvloop), main.add_arguments(parser).
"""
