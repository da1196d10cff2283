"""`undercurrent`: generate with probes, manage probes, capture activations, describe
the model, and audit the routers' verdict log (undercurrent_client.audit),
from a shell.

Errors are one line on stderr: `undercurrent: error: ...`; exit status 2 for bad
usage, 1 for a failed call (naming its gRPC status) or a request that ended in
ERROR.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import grpc

from common.capture_spec import Scope, TokenSelector, tensor_type_from_proto
from common.enum_names import short_name
from undercurrent_client import audit
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import capture_file
from undercurrent_client.activations import ActivationSet
from undercurrent_client.client import EngineClient, ProbeAdminClient
from undercurrent_client.connection import Connection, PlaintextToken
from undercurrent_client.errors import RpcError
from undercurrent_client.events import (
    Activations,
    Finished,
    Generation,
    ProbeScores,
    Started,
    Tokens,
    Verdict,
)
from undercurrent_client.requests import Probe, point

PROG = "undercurrent"
ENGINE_ENV = "UNDERCURRENT_ENGINE"
ROUTER_ENV = "UNDERCURRENT_ROUTER"
TOKEN_ENV = "UNDERCURRENT_TOKEN"
NO_FINISHED = "the stream ended without a finished event"


class UsageError(Exception):
    """Bad input found after parsing (exit 2)."""


class _TokenOnCommandLine(argparse.Action):
    """A token on the command line shows in `ps` and in shell history: refused, saying where it goes."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"--token: give the token in ${TOKEN_ENV} or in a file with --token-file, not on "
                     "the command line (it would show in ps and in shell history)")


class _Parser(argparse.ArgumentParser):
    """Every usage error starts with `undercurrent: error:`, naming the subcommand."""

    def error(self, message: str):
        command = self.prog.removeprefix(PROG).strip()
        self.exit(2, f"{PROG}: error: {command + ': ' if command else ''}{message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--tls-root-cert", metavar="PEM",
                            help="CA certificate of the server: connect with TLS")
    connection.add_argument("--tls-cert", metavar="PEM",
                            help="client certificate for mutual TLS (routers require one)")
    connection.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    connection.add_argument("--token-file", metavar="FILE",
                            help=f"file holding the bearer token sent on every call (default: ${TOKEN_ENV}); "
                                 "a token needs TLS")
    connection.add_argument("--token", action=_TokenOnCommandLine, nargs="?", help=argparse.SUPPRESS)
    connection.add_argument("--allow-token-over-plaintext", action="store_true",
                            help="send the token without TLS (a development service on loopback)")
    connection.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                            help="deadline of each call (default: none for generate and capture)")
    engine = argparse.ArgumentParser(add_help=False, parents=[connection])
    engine.add_argument("--engine", default=os.environ.get(ENGINE_ENV), metavar="HOST:PORT",
                        help=f"the engine's address (default: ${ENGINE_ENV})")
    router = argparse.ArgumentParser(add_help=False, parents=[connection])
    router.add_argument("--router", default=os.environ.get(ROUTER_ENV), metavar="HOST:PORT",
                        help=f"one router replica's address (default: ${ROUTER_ENV})")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, default=0, metavar="N",
                          help="most tokens to generate (default: the engine's, 64)")
    sampling.add_argument("--temperature", type=float, default=None,
                          help="0 is greedy (default 1.0)")
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="generate max-tokens tokens even past end-of-sequence")

    parser = _Parser(prog=PROG, description="Generate with probes, manage probes, capture "
                                            "activations, describe the model.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=_Parser)

    gen = commands.add_parser("generate", parents=[engine, sampling],
                              help="stream a generation with probe scores and the verdict")
    gen.add_argument("prompt")
    gen.add_argument("--probe", action="append", default=[], metavar="NAME",
                     help="bind a probe loaded in the routers (repeatable)")
    gen.add_argument("--action", choices=("observe", "abort"), default=None,
                     help="override the probes' action (default: each manifest's)")
    gen.add_argument("--failure-policy", choices=("fail_open", "fail_closed"), default=None,
                     help="while a router is unreachable (default: the engine's)")
    gen.add_argument("--gate", action="store_true",
                     help="release each token only after the routers scored it")
    gen.add_argument("--request-id", default="")
    gen.set_defaults(run=run_generate)

    probes = commands.add_parser("probes", help="list, load and unload probes on a router")
    actions = probes.add_subparsers(dest="action", required=True, metavar="ACTION",
                                    parser_class=_Parser)
    listing = actions.add_parser("list", parents=[router], help="list the loaded probes")
    listing.set_defaults(run=run_probes_list)
    load = actions.add_parser("load", parents=[router], help="load a probe")
    load.add_argument("path", help="a probe directory or .safetensors file on the router "
                                   "(with --upload: on this machine)")
    load.add_argument("--upload", action="store_true", help="send the local probe inline")
    load.add_argument("--replace", action="store_true", help="swap a loaded probe of that name")
    role = load.add_mutually_exclusive_group()
    role.add_argument("--shadow", action="store_true",
                      help="load it beside the serving version of its name: it scores the same rows, never "
                           "acts, and the router counts where it agrees (docs/rollout.md)")
    role.add_argument("--canary", type=float, metavar="SHARE",
                      help="load it as a canary acting on this share (0-1] of new requests, picked by a "
                           "stable hash of the request id")
    load.set_defaults(run=run_probes_load)
    promote = actions.add_parser("promote", parents=[router],
                                 help="make a probe's canary or shadow its serving version, for new requests")
    promote.add_argument("name")
    promote.set_defaults(run=run_probes_promote)
    roll_back = actions.add_parser("roll-back", parents=[router],
                                   help="drop a probe's canary or shadow, for new requests")
    roll_back.add_argument("name")
    roll_back.set_defaults(run=run_probes_roll_back)
    unload = actions.add_parser("unload", parents=[router], help="unload a probe")
    unload.add_argument("name")
    unload.add_argument("--force", action="store_true",
                        help="unload now even if running requests use it")
    unload.set_defaults(run=run_probes_unload)

    cap = commands.add_parser("capture", parents=[engine, sampling],
                              help="capture activations of prompts into a safetensors file")
    cap.add_argument("prompts", nargs="*", metavar="PROMPT")
    cap.add_argument("--prompts-file", metavar="FILE", help="one prompt per line")
    cap.add_argument("--point", action="append", default=[], required=True,
                     metavar="TYPE:LAYER[,LAYER]",
                     help="e.g. residual_stream:12, mlp_out:0,2 or final_norm (repeatable)")
    cap.add_argument("--tokens", choices=[scope.value for scope in Scope], default="all",
                     help="which token positions to capture (default: all)")
    cap.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write")
    cap.set_defaults(run=run_capture)

    info = commands.add_parser("model-info", parents=[engine], help="describe the served model")
    info.set_defaults(run=run_model_info)
    audit.add_commands(commands)
    return parser


def main(argv: list[str] | None = None, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = build_parser().parse_args(argv)
    try:
        return args.run(args, out, err)
    except UsageError as problem:
        err.write(f"{PROG}: error: {problem} (see --help)\n")
        return 2
    except audit.AuditError as problem:
        err.write(f"{PROG}: error: audit {args.audit_action}: {problem}\n")
        return problem.status
    except RpcError as problem:
        err.write(f"{PROG}: error: {problem.method} failed with {problem.code.name}: "
                  f"{problem.details}\n")
        return 1
    except KeyboardInterrupt:
        err.write(f"{PROG}: interrupted\n")
        return 130


def _connection(args, flag: str) -> Connection:
    target = getattr(args, flag)
    if not target:
        env = ENGINE_ENV if flag == "engine" else ROUTER_ENV
        raise UsageError(f"--{flag} HOST:PORT is required (or set ${env})")
    for option in ("tls_root_cert", "tls_cert", "tls_key"):
        path = getattr(args, option)
        if path and not os.path.isfile(path):
            raise UsageError(f"--{option.replace('_', '-')} {path!r} is not a file")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    try:
        return Connection(target, root_certificates=args.tls_root_cert, certificate_chain=args.tls_cert,
                          private_key=args.tls_key, token=_token(args),
                          allow_token_over_plaintext=args.allow_token_over_plaintext)
    except PlaintextToken:
        raise UsageError("a token is sent only over TLS: give --tls-root-cert (or "
                         "--allow-token-over-plaintext for a development service)") from None


def _token(args) -> str | None:
    """The token from --token-file, else $UNDERCURRENT_TOKEN."""
    if not args.token_file:
        return os.environ.get(TOKEN_ENV) or None
    try:
        token = open(args.token_file).read().strip()
    except OSError as err:
        raise UsageError(f"--token-file {args.token_file!r}: {err.strerror}") from None
    if not token or any(ch.isspace() for ch in token):
        raise UsageError(f"--token-file {args.token_file!r}: must hold one token and nothing else")
    return token


def _sampling(args) -> dict:
    if args.max_tokens < 0:
        raise UsageError(f"--max-tokens {args.max_tokens} must be >= 0")
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
                ignore_eos=args.ignore_eos)


# -- generate ----------------------------------------------------------------


class _LiveView:
    """Streams text as it arrives and puts each batch of probe scores on a line of
    its own, so scores show beside the tokens they belong to."""

    def __init__(self, out: TextIO):
        self.out = out
        self.at_line_start = True
        self.prompt_tokens = 0

    def text(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.at_line_start = text.endswith("\n")
            self.out.flush()

    def line(self, line: str) -> None:
        if not self.at_line_start:
            self.out.write("\n")
        self.out.write(line + "\n")
        self.at_line_start = True
        self.out.flush()

    def token(self, position: int) -> str:
        """Generated tokens by their index (0 is the first), prompt tokens as pN."""
        if position < self.prompt_tokens:
            return f"p{position}"
        return str(position - self.prompt_tokens)

    def scores(self, event: ProbeScores) -> None:
        shown = " ".join(f"{self.token(p)}:{s:.4g}"
                         for p, s in zip(event.token_positions, event.scores))
        self.line(f"  [{event.probe}] {shown}")


    def verdict(self, v: Verdict) -> None:
        if v.probe:
            router = f" (router {v.router})" if v.router else ""
            self.line(f"verdict: probe {v.probe} score {v.score:.4g} at token "
                      f"{self.token(v.token_position)}{router}: {v.reason}")
        else:  # the engine's own verdict, e.g. no router reachable for a fail_closed binding
            self.line(f"verdict: {v.reason}")


def run_generate(args, out: TextIO, err: TextIO) -> int:
    connection = _connection(args, "engine")
    probes = [Probe(name, args.failure_policy, args.action) for name in args.probe]
    view = _LiveView(out)
    finished: Finished | None = None
    with EngineClient(connection, timeout=args.timeout) as engine:
        for event in engine.generate(args.prompt, probes=probes, gate_tokens=args.gate or None,
                                     request_id=args.request_id, **_sampling(args)):
            if isinstance(event, Started):
                view.prompt_tokens = event.prompt_tokens
                err.write(f"request {event.request_id}: {event.prompt_tokens} prompt tokens"
                          + ("; probe scores as [probe] token:score (generated tokens from 0, "
                             "prompt tokens as pN)" if probes else "")
                          + "\n")
                err.flush()
            elif isinstance(event, Tokens):
                view.text(event.text)
            elif isinstance(event, ProbeScores):
                view.scores(event)
            elif isinstance(event, Finished):
                finished = event
    if finished is None:
        raise RpcError("Generate", grpc.StatusCode.UNKNOWN, NO_FINISHED)
    view.line(f"finished: {finished.reason}, {finished.generated_tokens} tokens generated"
              + (f", {finished.unprobed_tokens} unprobed" if finished.unprobed_tokens else "")
              + (f", {finished.dropped_records} records dropped"
                 if finished.dropped_records else ""))
    if finished.verdict is not None:
        view.verdict(finished.verdict)
    if finished.reason == "ERROR":
        err.write(f"{PROG}: error: the engine failed the request: {finished.message}\n")
        return 1
    return 0


# -- probes ------------------------------------------------------------------


def _describe(probe: types_pb.ProbeInfo) -> list[str]:
    return [
        probe.name, short_name(types_pb.ProbeKind, probe.kind).lower(),
        tensor_type_from_proto(probe.tensor_type), ",".join(map(str, probe.layers)),
        short_name(types_pb.ProbeAction, probe.action).lower(),
        f"{probe.threshold:g}", probe.version,
        str(probe.active_requests) + (" (unloading)" if probe.unloading else ""),
    ]


def _role(probe: types_pb.ProbeInfo) -> str:
    """The probe's part in a rollout as listed: serving, shadow, or canary and its share."""
    role = short_name(types_pb.ProbeRole, probe.role or types_pb.PROBE_ROLE_SERVING).lower()
    return f"{role} {probe.canary_share:.4g}" if probe.role == types_pb.PROBE_ROLE_CANARY else role


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")


def run_probes_list(args, out: TextIO, err: TextIO) -> int:
    with ProbeAdminClient(_connection(args, "router"), timeout=args.timeout or 30) as admin:
        probes = admin.list()
    if not probes:
        out.write("no probes loaded\n")
        return 0
    header = ["NAME", "KIND", "TENSOR", "LAYERS", "ACTION", "THRESHOLD", "VERSION", "ACTIVE"]
    if any(p.role not in (types_pb.PROBE_ROLE_UNSPECIFIED, types_pb.PROBE_ROLE_SERVING) for p in probes):
        header.append("ROLE")  # only while some probe is in a rollout
        rows = [_describe(p) + [_role(p)] for p in sorted(probes, key=lambda p: (p.name, p.role))]
    else:
        rows = [_describe(p) for p in sorted(probes, key=lambda p: p.name)]
    _table([header, *rows], out)
    return 0


def run_probes_load(args, out: TextIO, err: TextIO) -> int:
    with ProbeAdminClient(_connection(args, "router"), timeout=args.timeout or 30) as admin:
        role = dict(replace=args.replace, shadow=args.shadow, canary=args.canary)
        if args.upload:
            try:
                probe = admin.load(upload=args.path, **role)
            except ValueError as problem:
                raise UsageError(str(problem)) from None
        else:
            probe = admin.load(args.path, **role)
    name, kind, tensor, layers, action, threshold, version, _ = _describe(probe)
    rollout = "" if probe.role == types_pb.PROBE_ROLE_SERVING else f" as {_role(probe)}"
    out.write(f"loaded {name} (version {version}){rollout}: {kind} on {tensor} layers {layers}, "
              f"{action} at {threshold}\n")
    return 0


def run_probes_promote(args, out: TextIO, err: TextIO) -> int:
    return _end_rollout(args, out, promote=True)


def run_probes_roll_back(args, out: TextIO, err: TextIO) -> int:
    return _end_rollout(args, out, promote=False)


def _end_rollout(args, out: TextIO, promote: bool) -> int:
    with ProbeAdminClient(_connection(args, "router"), timeout=args.timeout or 30) as admin:
        probe = admin.promote(args.name) if promote else admin.roll_back(args.name)
    out.write(f"{probe.name}: version {probe.version}{'' if promote else ' alone'} serves new requests; "
              "running requests keep their versions\n")
    return 0


def run_probes_unload(args, out: TextIO, err: TextIO) -> int:
    with ProbeAdminClient(_connection(args, "router"), timeout=args.timeout or 30) as admin:
        if admin.unload(args.name, force=args.force):
            out.write(f"unloaded {args.name}\n")
        else:
            out.write(f"{args.name} is unloading: it takes no new requests and goes when its "
                      f"running requests end (--force unloads now)\n")
    return 0


# -- capture -----------------------------------------------------------------

def _prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file:
        try:
            with open(args.prompts_file, encoding="utf-8") as handle:
                prompts += [line.rstrip("\n") for line in handle if line.strip()]
        except OSError as problem:
            raise UsageError(f"--prompts-file {args.prompts_file!r}: {problem.strerror}") from None
    if not prompts:
        raise UsageError("give at least one PROMPT or --prompts-file")
    return prompts


def run_capture(args, out: TextIO, err: TextIO) -> int:
    connection = _connection(args, "engine")
    prompts = _prompts(args)
    selector = TokenSelector(scope=Scope(args.tokens)).to_proto()
    try:
        points = [point(spec, tokens=selector) for spec in args.point]
    except ValueError as problem:
        raise UsageError(f"--point {problem}") from None
    if len({p.name for p in points}) != len(points):
        raise UsageError("--point: the same point is given twice")
    # On a terminal the current prompt's line updates as rows arrive; logs get one line each.
    live = err.isatty()
    carriage_return = "\r" if live else ""
    requests: list[capture_file.CapturedRequest] = []
    activations = ActivationSet()
    with EngineClient(connection, timeout=args.timeout) as engine:
        model = engine.model_info()
        for i, prompt in enumerate(prompts, start=1):
            run = Generation(activations=activations)
            rows = 0
            for event in engine.generate(prompt, points=points, **_sampling(args)):
                run.add(event)
                if isinstance(event, Activations):
                    rows += sum(len(b.token_positions) for b in event.batch.blocks)
                    if live:
                        err.write(f"\r[{i}/{len(prompts)}] {run.request_id}: "
                                  f"{len(run.token_ids)} tokens, {rows} rows")
                        err.flush()
            done = run.finished
            if done is None:
                raise RpcError("Generate", grpc.StatusCode.UNKNOWN, NO_FINISHED)
            err.write(f"{carriage_return}[{i}/{len(prompts)}] {run.request_id}: "
                      f"{done.generated_tokens} tokens, {rows} rows, {done.reason}\n")
            if done.reason == "ERROR":
                err.write(f"{PROG}: error: the engine failed request {run.request_id}: "
                          f"{done.message}\n")
                return 1
            requests.append(capture_file.CapturedRequest(
                run.request_id, prompt, done.prompt_tokens, done.generated_tokens, done.reason,
                run.text))
    records, groups = capture_file.from_activations(activations, requests, points, model)
    capture_file.write(args.out, model, records, requests, groups)
    total = sum(len(g.positions) for g in groups)
    out.write(f"wrote {args.out}: {len(requests)} requests, {total} rows in {len(groups)} "
              f"(point, layer) groups\n")
    for group in sorted(groups, key=lambda g: (g.point, g.layer)):
        out.write(f"  {capture_file.tensor_name(group.point, group.layer, 'rows')}  "
                  f"{list(group.rows.shape)}\n")
    return 0


# -- model-info --------------------------------------------------------------


def run_model_info(args, out: TextIO, err: TextIO) -> int:
    with EngineClient(_connection(args, "engine"), timeout=args.timeout or 30) as engine:
        info = engine.model_info()
    types = ", ".join(tensor_type_from_proto(t) for t in info.tensor_types)
    out.write(
        f"model         {info.model}\n"
        f"architecture  {info.architecture}\n"
        f"layers        {info.num_layers}\n"
        f"hidden size   {info.hidden_size}\n"
        f"dtype         {info.dtype}\n"
        f"vocabulary    {info.vocab_size}\n"
        f"max length    {info.max_model_len}\n"
        f"topology      TP={info.tensor_parallel_size} PP={info.pipeline_parallel_size}\n"
        f"tensor types  {types}\n"
        f"vllm          {info.vllm_version}\n"
    )
    for r in info.ranks:
        out.write(f"rank {r.rank}        tp {r.tp_rank} pp {r.pp_rank} layers [{r.start_layer}, "
                  f"{r.end_layer})" + (" + final norm" if r.has_final_norm else "") + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
