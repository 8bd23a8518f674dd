"""The `diloco` command line: run, syncer, learner, status, inspect, simulate."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from diloco import checks, secret_sources, static

from diloco.options import (  # noqa: F401  (also this module's names: tests and scripts import them from here)
    CODECS, MODES, PRESETS, SYNC_FLAGS, WIRE_COMPRESSIONS, Parser, UserError, __version__, add_config_options,
    add_sync_options, add_train_options, address, addresses, model_config, positive_seconds, resolved_sync_config,
    shard_spec, sync_overrides, train_config,
)

# read from the source, not imported: the server imports torch and gRPC, which `diloco --help` must not wait for
PUSH_BUFFER, AGREEMENT_BUFFER, CHANGE_BUFFER = (static.constant("diloco.syncer.serving.server", name)
                                                for name in ("PUSH_BUFFER", "AGREEMENT_BUFFER", "CHANGE_BUFFER"))


def cmd_inspect(args) -> int:
    from rich.console import Console

    from diloco.syncer.observation.tape import read_all, render, summarise

    for path in args.tape:
        if not path.exists():
            raise UserError(f"no tape at {path}: a syncer started with --state DIR writes DIR/tape.jsonl")
    summary = summarise(read_all(args.tape))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    render(summary, Console())
    return 0


def cmd_replay(args) -> int:
    from diloco.syncer.replay import latency_summary, replay, wake_up_latency
    from diloco.syncer.observation.tape import read

    if not args.tape.exists():
        raise UserError(f"no tape at {args.tape}: a syncer started with --state DIR writes DIR/tape.jsonl")
    if not args.slack >= 0:
        raise UserError(f"--slack must be ≥ 0 seconds, got {args.slack}")
    events = read(args.tape)
    replayed, differences = replay(events, args.slack)
    for d in differences[:50]:
        print(f"fragment {d.fragment} version {d.version}: {d.what}")
    if len(differences) > 50:
        print(f"... and {len(differences) - 50} more")
    print(f"{replayed} rounds replayed, {len(differences)} differences")
    print(latency_summary(wake_up_latency(events)))
    return 1 if differences else 0


def cmd_credentials(args) -> int:
    from diloco.syncer.defences.credentials import CredentialsError, add

    try:
        token = add(args.file, args.learner_id)
    except CredentialsError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"--file {args.file}: cannot write it ({e.strerror})") from None
    print(token)
    print(f"learner {args.learner_id}'s token (shown once; its SHA-256 is in {args.file})", file=sys.stderr)
    return 0


RESTARTED = "DILOCO_ALLOCATOR_RESTARTED"
"""Set in a syncer's environment when it started itself again to preload jemalloc: it does so once."""


def use_allocator(wanted: str, restart: bool) -> None:
    """Run this syncer on the allocator `--allocator` names. For jemalloc, found but not loaded, the process starts
    itself again with it preloaded (`os.execve`: the same pid, arguments and environment), before it has allocated
    anything of size; `restart` False (a syncer started in-process) cannot."""
    from diloco import allocator

    if wanted == "glibc" or allocator.name() == "jemalloc":
        return
    library = allocator.find_jemalloc()
    if library is None:
        problem = "jemalloc is not installed (apt-get install libjemalloc2; dnf install jemalloc)"
    elif os.environ.get(RESTARTED):
        problem = f"{library} did not load when preloaded (LD_PRELOAD)"
    elif not restart:
        problem = "a syncer started inside another program runs on the allocator that program started with"
    else:
        os.execve(sys.executable, sys.orig_argv, {**allocator.preload_env(dict(os.environ), library), RESTARTED: "1"})
    raise UserError(f"--allocator jemalloc: {problem}; or leave out --allocator (glibc's malloc)")


def cmd_syncer(args) -> int:
    use_allocator(args.allocator, args.own_process)  # before anything of size is allocated
    from diloco.allocator import limit_arenas, map_large
    from diloco.syncer.serving.server import ServerOptions, serve

    limit_arenas()  # before any thread allocates (diloco.allocator)
    map_large()

    cfg = resolved_sync_config(args)
    if cfg.split_tensors and args.shard[1] > 1:
        raise UserError("--split-tensors cannot be used with --shard: each shard writes whole tensors to its model "
                        "file, and a split tensor's pieces would lie in several shards; run one syncer, or shard "
                        "without --split-tensors")
    for flag in ("--push-buffer", "--agreement-buffer", "--change-buffer"):
        share = getattr(args, flag[2:].replace("-", "_"))
        if not 0 <= share < float("inf"):
            raise UserError(f"{flag} must be a share of the model's size, 0 (no bound) or more, got {share}")
    if not 0 <= args.trim_above < float("inf"):
        raise UserError(f"--trim-above must be MiB, 0 (never) or more, got {args.trim_above}")
    if not 0 <= args.send_window < float("inf"):
        raise UserError(f"--send-window must be MiB, 0 (no bound) or more, got {args.send_window}")
    state = args.state
    if state is None:  # a syncer always keeps its final model somewhere it says
        state = default_state_folder()
        checks.writable_dir("--state", state.parent)
        print(f"no --state given: the syncer keeps its state and the final model in {state} (pass --state DIR to "
              f"choose the folder, and the same DIR again to resume after a restart)", file=sys.stderr)
    else:
        checks.writable_dir("--state", state)
    opts = ServerOptions(listen=args.listen, http=args.http, out=state, token=args.token,
                         token_budget=args.tokens, duration=args.duration, snapshot_seconds=args.snapshot_every,
                         tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                         snapshot_tokens=args.snapshot_tokens, stall_timeout=args.stall_timeout, recover=args.state_recover,
                         accept_rollback=args.accept_rollback, accept_unsigned=args.accept_unsigned,
                         state_key=args.state_key,
                         insecure=args.insecure, status_token=args.status_token,
                         allow_takeover=args.allow_takeover, shard=args.shard, initial_model=args.initial_model,
                         exit_when_done=args.exit_when_done, push_buffer_share=args.push_buffer,
                         send_window=int(args.send_window * 2**20), agreement_buffer_share=args.agreement_buffer,
                         change_buffer_share=args.change_buffer,
                         trim_above=int(args.trim_above * 2**20),
                         credentials=args.credentials, client_cert_ids=args.client_cert_ids)
    try:
        status = asyncio.run(serve(cfg, opts))
    finally:
        if args.state is None and state.is_dir() and not (state / "ready.json").exists():
            shutil.rmtree(state, ignore_errors=True)  # a syncer that never served leaves no folder of its own behind
    model = status.get("final_model")
    where = f"the final model is {model}" if model else f"no final model in {state} (no learner joined, or see the log)"
    print(f"syncer stopped after {status.get('rounds', 0)} rounds; tokens merged {status.get('tokens_merged', 0):.0f}; "
          f"{where}")
    return 0


def default_state_folder() -> Path:
    """runs/syncer-<time>-<pid>: a new folder per syncer process, so that nothing is resumed by accident."""
    return Path("runs") / f"syncer-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def leave_on_signal():
    """SIGTERM or Ctrl-C removes the learner from the run cleanly: it pushes what is left and leaves. A second
    signal stops it at once."""
    import signal
    import threading

    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("leaving the run after this step (signal again to stop at once)", file=sys.stderr)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def learner_device(choice: str, local_rank: int = 0):
    """The torch device for `--device auto|cpu|cuda` (a torchrun rank takes the GPU of its local rank)."""
    import torch

    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible to this process (check CUDA_VISIBLE_DEVICES and "
                        "the torch build: `python -c 'import torch; print(torch.cuda.is_available())'`), or use --device cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def island_group(device):
    """Under torchrun (WORLD_SIZE > 1) this process is one rank of a learner: join the job's process group."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.group.WORLD


def cmd_learner(args) -> int:
    import os

    import torch

    from diloco.learner.grpc_transport import GrpcTransport
    from diloco.learner.sharded import ShardedTransport
    from diloco.train.loop import WorkerOptions, run_learner
    from diloco.wire.tls import plaintext_token_problem

    from diloco import procs

    procs.die_with_parent_now()  # a torchrun rank of a `diloco run` learner ends with its launcher
    from diloco.ids import InvalidLearnerId, check_learner_id

    try:  # a usage mistake, said before anything starts (the syncer would refuse it too)
        check_learner_id(args.id)
    except InvalidLearnerId as e:
        raise UserError(f"--id: {e}") from None
    for flag, path in (("--metrics", args.metrics), ("--summary", args.summary),
                       ("--optimizer-state", args.optimizer_state)):
        if path is not None:
            checks.writable_file(flag, path)
    if args.tensorboard is not None:
        checks.writable_dir("--tensorboard", args.tensorboard)
    tls = bool(args.tls or args.tls_ca or args.tls_cert or args.tls_key)
    for target in args.syncer:
        problem = plaintext_token_problem(target, args.token, tls)
        if problem and not args.insecure:
            raise UserError(problem)
        if problem:
            logging.getLogger("diloco.learner").warning("sending the run token to %s in plaintext (--insecure)", target)
    torch.set_num_threads(args.threads)
    cfg = train_config(args)
    device = learner_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    group = island_group(device)
    leader = group is None or int(os.environ.get("RANK", "0")) == 0
    opts = WorkerOptions(args.id, args.shard, args.num_shards, args.speed, args.pace, args.max_steps, args.metrics,
                         tensorboard=args.tensorboard / args.id if args.tensorboard else None, stop=leave_on_signal(),
                         optimizer_checkpoint=args.optimizer_state)
    options = dict(token=args.token or "", connect_timeout=args.connect_timeout, stall_timeout=args.stall_timeout,
                   tls=args.tls, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)
    transport = None
    if leader:
        transport = (GrpcTransport(args.syncer[0], **options) if len(args.syncer) == 1
                     else ShardedTransport(args.syncer, **options))
    import torch.distributed as dist

    try:
        summary = run_learner(cfg, transport, opts, device=device, process_group=group)
        if group is not None:
            # what held the group (model, optimizer, learner) goes while it lives, and no rank tears it down while
            # another still uses it: gloo's threads aborted a rank at exit otherwise, rarely (docs/operations.md)
            gc.collect()
            dist.barrier()
    finally:
        if group is not None:
            dist.destroy_process_group()
    if not leader:
        return 0
    print(f"learner {summary['id']}: {summary['steps']} steps, {summary['tokens']} tokens, "
          f"{summary['pushes']} pushes, {summary['applied']} fragments applied")
    if args.summary:
        import json

        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="diloco",
        description="Decoupled DiLoCo: train one model on several independent, unreliable learners.",
    )
    parser.add_argument("--version", action="version", version=f"diloco {__version__}")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (syncer and learner: INFO, with a line "
                                            "of progress a minute; others: WARNING)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")  # subcommands' parsers are Parsers too
    sub.required = True
    parser.commands = sub.choices

    from diloco.run import run_command as run_cli

    run_cli.register(sub, add_sync_options, add_train_options)
    from diloco.run import compare

    compare.register(sub)

    p = sub.add_parser("syncer", help="run the central syncer alone", description="Serve the global model to learners.")
    n = p.add_argument_group("network and security")
    n.add_argument("--listen", type=address, default="127.0.0.1:50051", help="gRPC HOST:PORT (127.0.0.1:50051)")
    n.add_argument("--http", type=address, default="127.0.0.1:8080", help="HOST:PORT of the dashboard, /status, /history and /metrics")
    n.add_argument("--token", help="secret shared by trusted learners (beyond loopback: this or --credentials, never "
                                   "both); prefer --token-file or $DILOCO_TOKEN, which `ps` does not show")
    secret_sources.add_file_flag(n, "token", "the shared secret")
    n.add_argument("--credentials", type=Path, metavar="FILE",
                   help="per-learner credentials (TOML, `diloco credentials new ID --file FILE`): each listed id "
                        "joins only with its own token, and reclaims its id with it after a restart; read again when "
                        "it changes and on SIGHUP, so an id removed (or given a new token) is revoked at once")
    n.add_argument("--client-cert-ids", action="store_true",
                   help="with --tls-client-ca: a learner's client certificate names its id (common name) and is its "
                        "credential; it joins under that id only")
    n.add_argument("--status-token", help="read-only secret for /status, /history and /metrics beyond loopback "
                                          "(`Authorization: Bearer ...`); loopback clients need none")
    secret_sources.add_file_flag(n, "status_token", "the read-only status secret")
    n.add_argument("--tls-cert", type=Path, help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    n.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    n.add_argument("--tls-client-ca", type=Path, help="require learners to present certificates signed by this CA")
    n.add_argument("--insecure", action="store_true",
                   help="allow --token (and /status's) to travel in plaintext beyond loopback, without TLS (warns)")
    n.add_argument("--allow-takeover", action="store_true",
                   help="let a Join under a live learner's id supersede it without that learner's session secret "
                        "(by default only the learner itself, or one whose stream ended, can take its id)")
    n.add_argument("--stall-timeout", type=positive_seconds, default=60.0,
                   help="seconds the learner uploading the initial model may send nothing before another takes over (60)")
    n.add_argument("--push-buffer", type=float, default=PUSH_BUFFER, metavar="SHARE",
                   help="payload bytes of pushes the syncer holds at once, as a share of the model's fp32 size "
                        f"({PUSH_BUFFER}): pushes beyond it wait (never fail), so its memory does not grow with the "
                        "learners; a smaller share holds less and makes pushes wait longer; 0: no bound")
    n.add_argument("--send-window", type=float, default=8.0, metavar="MIB",
                   help="MiB an update stream may send beyond what its learner says it received (8): answers to a "
                        "slow reader wait in its queue, not in gRPC's buffers; 0: no bound")
    n.add_argument("--allocator", choices=("glibc", "jemalloc"), default="glibc",
                   help="the syncer's memory allocator: glibc's malloc (the default), or jemalloc (apt-get install "
                        "libjemalloc2), which keeps almost nothing per learner that joined (glibc about 0.7 MiB) "
                        "and takes less CPU per push, for a slightly higher peak (docs/operations.md)")
    n.add_argument("--trim-above", type=float, default=0.0, metavar="MIB",
                   help="every 2 s, give the memory malloc keeps free back to the system when it is more than this "
                        "many MiB (0: never, the default)")
    n.add_argument("--agreement-buffer", type=float, default=AGREEMENT_BUFFER, metavar="SHARE",
                   help="bytes of open rounds' payloads the agreement test keeps in memory, as a share of the model's "
                        f"fp32 size ({AGREEMENT_BUFFER}): beyond it they wait in unnamed files in the --state folder "
                        "until their round closes, so memory does not grow with the learners; 0: no bound")
    n.add_argument("--change-buffer", type=float, default=CHANGE_BUFFER, metavar="SHARE",
                   help="bytes of merged-fragment changes the syncer keeps for learners that lag, as a share of the "
                        f"model's fp32 size ({CHANGE_BUFFER}): beyond it the oldest are dropped, and a learner that "
                        "misses one is sent full values, so the changes never hold more than this share of memory; "
                        "0: no bound")
    b = p.add_argument_group("budget (none: run until stopped)")
    b.add_argument("--tokens", type=int, help="stop the run after this many trained tokens in total, then exit")
    b.add_argument("--duration", type=float,
                   help="stop the run this many seconds after training started (a learner's first step); the "
                        "syncer exits once every learner has left")
    b.add_argument("--exit-when-done", action=argparse.BooleanOptionalAction, default=True,
                   help="exit once the budget is spent and every learner has left (default); --no-exit-when-done "
                        "serves until stopped (SIGTERM), as under `diloco run`, which stops its syncer itself once "
                        "its learners, restarted ones included, are done")
    o = p.add_argument_group("output and state")
    o.add_argument("--state", type=Path, help="directory for snapshots, the final model and syncer.json (default: a "
                   "new runs/syncer-<time>-<pid>; give the same DIR again to resume after a restart)")
    o.add_argument("--snapshot-every", type=float, default=0.0, help="seconds between model snapshots in --state")
    o.add_argument("--snapshot-tokens", type=int, default=0, help="trained tokens between model snapshots in --state")
    o.add_argument("--state-recover", action="store_true",
                   help="if the newest state in --state is damaged, resume from the previous consistent one")
    o.add_argument("--accept-rollback", action="store_true",
                   help="resume from --state even if it is older than the newest state this syncer wrote (a backup), "
                        "or if the record of that (beside the state key) is missing")
    o.add_argument("--accept-unsigned", action="store_true",
                   help="resume a --state written before state keys existed (unsigned, no key); never one that was "
                        "signed: its next save signs it")
    o.add_argument("--state-key", type=Path, metavar="FILE",
                   help="the key that signs the state's manifests, one per state folder, with the record of the "
                        "newest generation beside it (the same name ending in .generation; default: --state/state.key, "
                        "made on the first start); kept where the state's writers cannot write, a whole older --state "
                        "put back is refused too")
    o.add_argument("--initial-model", type=Path, metavar="FILE.safetensors",
                   help="start from this checkpoint (e.g. the learners' pretrained weights, or a model.safetensors "
                        "this syncer wrote): no learner uploads the model, and learners holding the same values "
                        "download none of it")
    r = p.add_argument_group("learners and shards")
    r.add_argument("--learners", type=int, default=1, help="learners expected (sets K for streaming/diloco)")
    r.add_argument("--shard", type=shard_spec, default=(0, 1), metavar="I/N",
                   help="run as shard I of N syncers, serving the fragments p with p mod N = I (learners take every "
                        "shard's address: --syncer A,B,...); each shard needs its own --state directory")
    p.add_argument("--sync-config", type=Path, help=argparse.SUPPRESS)  # resolved settings from `diloco run`
    add_sync_options(p, modes=("decoupled", "streaming", "diloco"))
    add_config_options(p)
    p.set_defaults(func=cmd_syncer)

    p = sub.add_parser("learner", help="run one learner of the built-in trainer",
                       description="Train as one learner. Under torchrun (`torchrun --nproc-per-node N -m diloco learner "
                                   "...`) the N ranks form one learner: DDP inside it, rank 0 talks to the syncer.")
    n = p.add_argument_group("network and security")
    n.add_argument("--syncer", type=addresses,
                   help="HOST:PORT of the syncer; of a sharded syncer, every shard's in shard order: A,B,... (required)")
    n.add_argument("--id", help="stable learner name; re-joining under it resumes its data (required)")
    n.add_argument("--token", help="the syncer's shared secret, or this learner's credential token; prefer "
                                   "--token-file or $DILOCO_TOKEN, which `ps` does not show")
    secret_sources.add_file_flag(n, "token", "the token")
    n.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    n.add_argument("--tls-ca", type=Path, help="connect with TLS, trusting this PEM CA certificate")
    n.add_argument("--tls-cert", type=Path, help="client certificate for a syncer that requires one (with --tls-key)")
    n.add_argument("--tls-key", type=Path, help="PEM private key of the client --tls-cert")
    n.add_argument("--insecure", action="store_true",
                   help="allow --token to travel in plaintext to a syncer beyond loopback, without TLS (warns)")
    n.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to keep retrying an unreachable syncer")
    n.add_argument("--stall-timeout", type=positive_seconds, default=60.0,
                   help="abort a transfer (join, initial upload, push) when no bytes moved for this long (60), or "
                        "a join or upload that broken connections start over when no attempt got further; transfers "
                        "have no fixed deadline, so big models on slow links get through")
    b = p.add_argument_group("budget (default: until the syncer says the run is over)")
    b.add_argument("--max-steps", type=int, help="stop after this many steps")
    d = p.add_argument_group("data shard, speed and device")
    d.add_argument("--shard", type=int, default=0, help="which data shard to read (0)")
    d.add_argument("--num-shards", type=int, default=1, help="how many shards the data is cut into (1)")
    d.add_argument("--speed", type=float, default=1.0, help="emulated speed factor; 0.25 = four times slower")
    d.add_argument("--pace", type=positive_seconds, metavar="SECONDS",
                   help="pad every step to SECONDS / --speed, so this learner's capacity is fixed (goodput)")
    d.add_argument("--threads", type=int, default=1, help="torch threads (1 when several learners share a machine)")
    d.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model trains: auto (CUDA when visible, else CPU), cpu or cuda; under torchrun each "
                        "rank takes the GPU of its LOCAL_RANK")
    o = p.add_argument_group("output")
    o.add_argument("--metrics", type=Path, help="append per-step JSON lines to this file")
    o.add_argument("--summary", type=Path, help="write this learner's summary JSON here at the end")
    o.add_argument("--optimizer-state", type=Path, metavar="FILE",
                   help="keep the inner AdamW state here (every 30 s and at the end) and resume from it when this "
                        "learner restarts under its id")
    o.add_argument("--tensorboard", type=Path, metavar="DIR",
                   help="also write this learner's curves as TensorBoard event files into DIR/<id>")
    add_train_options(p)
    add_config_options(p)
    p.set_defaults(func=cmd_learner, required_flags=("syncer", "id"))

    p = sub.add_parser("credentials", help="make a learner's own token for a syncer's --credentials file",
                       description="Add (or replace) a learner id's credential: a new token is printed once, and only "
                                   "its SHA-256 is written to FILE (created readable by you alone). The token alone goes "
                                   "to stdout: `(umask 077; diloco credentials new ID --file FILE > ID.token)`, then "
                                   "give ID.token to that learner alone (`diloco learner --id ID --token-file "
                                   "ID.token`) and start the syncer with --credentials FILE.")
    p.add_argument("action", choices=("new",), help="new: a token for ID")
    p.add_argument("learner_id", metavar="ID", help="the learner id the token proves")
    p.add_argument("--file", type=Path, required=True, help="the credentials file (TOML) the syncer reads")
    p.set_defaults(func=cmd_credentials)

    p = sub.add_parser("inspect", help="summarise a syncer's event tape (tape.jsonl in its --state directory)",
                       description="Participation per round, measured H per fragment, staleness, round and quorum "
                                   "times, refusals and membership, from a syncer's event tape.")
    p.add_argument("tape", type=Path, nargs="+",
                   help="tape.jsonl (rotated tape.jsonl.N files beside it are read too); several tapes (shards, a "
                        "run's faults.jsonl) are read as one, in time order")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("replay", help="recompute a tape's round decisions and merge weights with this code",
                       description="Replay the round policy and the merge weights of every round a syncer's event "
                                   "tape recorded, and report where this code decides differently (exit code 1).")
    p.add_argument("tape", type=Path, help="tape.jsonl (rotated tape.jsonl.N files beside it are read too)")
    p.add_argument("--slack", type=float, default=0.0, metavar="SECONDS",
                   help="with a changed policy: report a round it closes earlier only when earlier by more than this "
                        "(default 0: any; an unmodified run replays exactly, whatever the syncer's wake-up latency, "
                        "which is printed apart)")
    p.set_defaults(func=cmd_replay)

    from diloco import status_command
    from diloco.chaos import proxy_command as chaos_cli
    from diloco.sim import simulate_command as sim_cli

    status_command.register(sub)
    sim_cli.register(sub)
    chaos_cli.register(sub)
    return parser


def with_config(parser: Parser, args: argparse.Namespace, argv: list[str] | None) -> argparse.Namespace:
    """The arguments with --config's settings under the command line's (the file's values become the defaults),
    once every flag the command needs has a value."""
    command = parser.commands[args.command]
    defaults = {a.dest: a.default for a in command._actions}  # before a file's values replace them
    if getattr(args, "config", None):
        from diloco import config_file

        settings = config_file.load(args.config, args.command, command)
        command.set_defaults(**settings.flags)
        args = parser.parse_args(argv)
        args.sync_fields, args.train_fields = settings.sync, settings.train
    missing = [f"--{name.replace('_', '-')}" for name in getattr(args, "required_flags", ())
               if getattr(args, name, None) is None]
    if missing:
        raise UserError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (on the command "
                        f"line, or in a --config file)")
    args.parser_defaults = defaults
    secret_sources.resolve(args)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.own_process = argv is None  # this process is the command's own: it may start itself again (use_allocator)
    level = args.log_level or ("INFO" if args.command in ("syncer", "learner") else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from diloco.learner.transport import SyncerError
    from diloco.run.links import LinkError
    from diloco.run.cluster import RunFailed

    from diloco import exits

    try:
        args = with_config(parser, args, argv)
        if getattr(args, "print_config", False):
            from diloco import config_file

            print(config_file.dump(args.command, parser.commands[args.command], args, args.parser_defaults), end="")
            return exits.record(0)
        return exits.record(int(args.func(args) or 0))
    except KeyboardInterrupt:
        print("diloco: interrupted", file=sys.stderr)
        return exits.record(exits.INTERRUPTED)
    except (UserError, ValueError, SyncerError, OSError, RunFailed, LinkError) as e:
        print(f"diloco {args.command}: error: {e}", file=sys.stderr)
        return exits.record(exits.for_error(args.command, e))  # what a scheduler should do: diloco/exits.py


if __name__ == "__main__":
    sys.exit(main())
