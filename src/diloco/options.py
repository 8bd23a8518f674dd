"""The command line's shared pieces: the parser every command uses, the synchronisation, trainer and config-file
options, and the value types of flags. `diloco.cli` and the commands of `diloco.run` build on them; nothing here
imports a command, so no command imports another through it."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco import checks, static

# read from the source, not imported: both modules import torch, which `diloco --help` must not wait for
__version__ = static.constant("diloco", "__version__")
CODECS = static.constant("diloco.algorithm.codec", "CODECS")
MODES = static.constant("diloco.config", "MODES")
PRESETS = static.constant("diloco.config", "PRESETS")
WIRE_COMPRESSIONS = static.constant("diloco.config", "WIRE_COMPRESSIONS")
REPEAT_PUSHES = static.constant("diloco.config", "REPEAT_PUSHES")

SYNC_FLAGS = ("fragments", "split_tensors", "sync_every", "overlap", "quorum", "codec", "down_codec", "grace", "merge", "outer_lr",
              "outer_momentum", "max_staleness", "staleness_decay", "blend", "error_feedback", "heartbeat_seconds",
              "absent_after_seconds", "delayed_momentum", "momentum_every", "keep_overlap", "max_steps_ratio", "grace_expect_steps", "align_pushes",
              "sync_buffers", "max_norm_ratio", "norm_ceiling", "preset", "scale_partial_rounds", "direction_floor",
              "agreement_floor", "refuse_replays",
              "clamp_long_contributions", "publish_to", "rda_mean_fallback", "merge_at_close", "bf16_residual", "wire_compression",
              "clip_norm_ratio", "max_counter_ratio", "max_round_ratio", "repeat_push")


class UserError(Exception):
    """A mistake in how diloco was called; printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """Every diloco parser: flags must be spelled out (`--learner 3` is not `--learners 3`), and a bad flag or value
    gets the error and a pointer to --help, not the whole usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nsee `{self.prog} --help`\n")

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:  # named by the subcommand they were given to, which argparse leaves to the top parser
            command = getattr(self, "commands", {}).get(getattr(args, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return args


class _SyncGroups:
    """Puts each synchronisation flag in --help's "synchronisation" group or, for the settings SyncConfig marks as
    this project's additions ("Ours", docs/config.md), in "our additions"."""

    def __init__(self, p: argparse.ArgumentParser):
        self.plain = p.add_argument_group("synchronisation (defaults come from --mode)")
        self.ours = p.add_argument_group("our additions to the published algorithm (each a switch; --preset paper "
                                         "turns every one off)")
        self.names = static.ours()

    def add_argument(self, *flags, **kwargs):
        dest = kwargs.get("dest") or flags[0].lstrip("-").replace("-", "_")
        return (self.ours if dest in self.names else self.plain).add_argument(*flags, **kwargs)


def add_sync_options(p: argparse.ArgumentParser, modes=MODES) -> None:
    g = _SyncGroups(p)
    g.add_argument("--mode", default="decoupled", choices=modes, help="decoupled (default), streaming, diloco or dp")
    g.add_argument("--preset", choices=PRESETS,
                   help="default: the mode with this project's measured additions; paper: the published algorithm "
                        "exactly (every addition off, outer η 0.7 / μ 0.9, fp32 back), for reproduction: with K = 1 "
                        "its momentum on every round can diverge (--momentum-every N delays it; docs/results.md); "
                        "flags below still override")
    g.add_argument("--fragments", "-P", type=int, help="P: fragments the model is split into (decoupled: 24)")
    g.add_argument("--sync-every", "-H", type=int, help="H: inner steps between pushes of one fragment (24)")
    g.add_argument("--overlap", type=int, help="τ: steps between a push and applying its merged result (2)")
    g.add_argument("--quorum", "-K", type=int, help="K: learners a round needs (decoupled: 1; others: all)")
    g.add_argument("--codec", choices=CODECS, help="outer-gradient codec (decoupled: int4)")
    g.add_argument("--down-codec", choices=CODECS, help="codec of merged fragments sent back (decoupled: int8)")
    g.add_argument("--wire-compression", choices=WIRE_COMPRESSIONS,
                   help="zstd-compress int4/int8 payloads both ways: 5-17%% fewer bytes for some CPU (none)")
    g.add_argument("--grace", type=float, help="fixed grace window in seconds (default: adaptive)")
    g.add_argument("--grace-expect-steps", type=float, metavar="STEPS",
                   help="keep a round open for learners predicted to push within this many steps of its opening "
                        "(decoupled: H, one cycle; 0: the grace window only)")
    g.add_argument("--merge", choices=("rda", "mean"), help="merge rule for non-embedding tensors (rda)")
    g.add_argument("--rda-mean-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="merge as the weighted mean where RDA's mean direction vanishes (paper); --no-rda-mean-fallback "
                        "merges such a tensor to 0 and keeps one running sum per open round instead of two")
    g.add_argument("--merge-at-close", action=argparse.BooleanOptionalAction, default=None,
                   help="keep an open round's contributions encoded (in memory up to --agreement-buffer, on disk "
                        "beyond) and merge them when the round closes: no fp32 sums for open rounds, so memory does "
                        "not grow with the learners; each contribution is decoded twice (on)")
    g.add_argument("--bf16-residual", action=argparse.BooleanOptionalAction, default=None,
                   help="with a lossy --down-codec keep Θ as the published values plus a bf16 residual, half a model "
                        "less syncer memory (default preset: on; paper: off, a second fp32 copy)")
    g.add_argument("--outer-lr", type=float, help="η of the Nesterov outer step (decoupled: 1; others: 0.7)")
    g.add_argument("--outer-momentum", type=float, help="μ of the Nesterov outer step (decoupled: 0; others: 0.9)")
    g.add_argument("--max-staleness", type=int, help="refuse contributions this many versions behind (16)")
    g.add_argument("--max-steps-ratio", type=float,
                   help="refuse contributions of more than this many times H local steps (0: merge them, counted as H)")
    g.add_argument("--split-tensors", action=argparse.BooleanOptionalAction, default=None,
                   help="cut tensors larger than a P-th of the model into pieces in several fragments, so that no "
                        "push or apply costs much more than another (default: off, the paper's whole tensors)")
    g.add_argument("--scale-partial-rounds", action=argparse.BooleanOptionalAction, default=None,
                   help="scale a round's step by its share of the expected tokens (default preset: on; paper: off)")
    g.add_argument("--clamp-long-contributions", action=argparse.BooleanOptionalAction, default=None,
                   help="count contributions of more than H steps as H steps (default preset: on; paper: off)")
    g.add_argument("--publish-to", choices=("contributors", "live"),
                   help="who receives a merged fragment: the round's contributors (default preset) or every live "
                        "learner, which overwrites its progress on it (paper; needs --down-codec fp32)")
    g.add_argument("--repeat-push", choices=REPEAT_PUSHES,
                   help="a learner's push while its earlier push of the fragment is pending: close that round first "
                        "(default preset) or replace the earlier push in it, counters summed where the newer does not "
                        "cover them (paper; keeps each contributor's fp32 Δ while its round is open)")
    g.add_argument("--staleness-decay", type=float, help="λ: weight / (1 + λ·staleness) (0)")
    g.add_argument("--max-norm-ratio", type=float,
                   help="refuse contributions whose norm per step is over this multiple of the fragment's recent "
                        "accepted median (50; 0: off)")
    g.add_argument("--norm-ceiling", type=float,
                   help="refuse, from the first push, contributions whose norm per step is over this multiple of the "
                        "fragment's own norm (1; 0: off)")
    g.add_argument("--clip-norm-ratio", type=float, metavar="RATIO",
                   help="robust merge: scale a contribution down to this multiple of the norm per step other "
                        "credentials' contributions typically have (2; 0: off)")
    g.add_argument("--direction-floor", type=float, metavar="FRACTION",
                   help="direction test: merge a contribution scaled by its credential's recent cosine with the "
                        "fragment's recent steps over this fraction of other credentials' typical one, at most 1, 0 "
                        "at or below cosine 0 (0: off)")
    g.add_argument("--refuse-replays", action=argparse.BooleanOptionalAction, default=None,
                   help="refuse a push whose payload repeats, byte for byte, one accepted lately for its fragment "
                        "(on)")
    g.add_argument("--agreement-floor", type=float, metavar="FRACTION",
                   help="agreement test: merge a contribution scaled by its agreement with the other credentials' "
                        "contributions of its own round over this fraction of theirs with one another, at most 1 "
                        "(0.25; 0: off)")
    g.add_argument("--max-counter-ratio", type=float, metavar="RATIO",
                   help="count declared tokens and tokens per step as at most this multiple of other credentials' "
                        "typical ones, in weights, shares and the budget (4; 0: off)")
    g.add_argument("--max-round-ratio", type=float, metavar="RATIO",
                   help="drop a round whose merged step is over this multiple of the fragment's recent ones "
                        "(10; 0: off); non-finite rounds are always dropped")
    g.add_argument("--blend", type=float, help="α: θ ← α·θ + (1−α)·Θ on apply (0: overwrite); needs --no-keep-overlap")
    g.add_argument("--error-feedback", action="store_true", default=None, help="carry quantisation error into the next push")
    g.add_argument("--keep-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="on apply keep the local progress made since the push (decoupled: on; others: overwrite)")
    g.add_argument("--align-pushes", action=argparse.BooleanOptionalAction, default=None,
                   help="keep learners' push schedules in phase with their peers' (off by default)")
    g.add_argument("--sync-buffers", action=argparse.BooleanOptionalAction, default=None,
                   help="average floating-point buffers (BatchNorm statistics) every H steps (on); "
                        "--no-sync-buffers keeps them local after join")
    g.add_argument("--delayed-momentum", action=argparse.BooleanOptionalAction, default=None,
                   help="advance the outer momentum once per full round's worth of contributions (default preset: "
                        "on); --no-delayed-momentum advances it on every round, even partial ones")
    g.add_argument("--momentum-every", type=int, metavar="N",
                   help="delayed Nesterov: advance the outer momentum once every N rounds' worth of contributions, "
                        "plain steps between (1: every round)")
    g.add_argument("--heartbeat-seconds", type=float, help=argparse.SUPPRESS)
    g.add_argument("--absent-after-seconds", type=float, help="a learner silent this long is absent (10)")


def sync_overrides(args) -> dict:
    # the SyncConfig fields a config file's [sync] table set that have no flag (or a hidden one), then the flags
    flags = {name: getattr(args, name) for name in SYNC_FLAGS}
    return {**getattr(args, "sync_fields", {}), **{k: v for k, v in flags.items() if v is not None}}


def json_text(path: Path, flag: str) -> str:
    """A JSON settings file's text, read as untrusted (a regular file, bounded, not nested too deep)."""
    from diloco import untrusted_files

    try:
        data = untrusted_files.read_bytes(path, 1 << 20, follow_symlinks=True)
        untrusted_files.parse_json(data, path)
    except untrusted_files.UntrustedFileError as e:
        raise UserError(f"{flag} {path}: {e.why}") from None
    return data.decode()


def resolved_sync_config(args):
    """The SyncConfig that `diloco run` or `diloco syncer` runs with these arguments."""
    from diloco.config import SyncConfig, for_mode, validate

    if getattr(args, "sync_config", None):  # `diloco run` resolved them already
        cfg = SyncConfig.from_json(json_text(args.sync_config, "--sync-config"))
        validate(cfg)
        return cfg
    return for_mode(args.mode, args.learners, **sync_overrides(args))


def add_train_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and data (the built-in trainer)")
    g.add_argument("--model", choices=("small", "tiny"),
                   help="built-in model size: small (default, ~0.8M parameters) or tiny (fast checks)")
    g.add_argument("--train-config", type=Path, help="JSON file of the training settings (written by `diloco run`)")
    g.add_argument("--corpus", nargs="+", metavar="PATH", help="your own UTF-8 text files or folders (default: Shakespeare)")
    g.add_argument("--seed", type=int, help="seed of the model initialisation and data order (0)")
    g.add_argument("--batch-size", type=int, help="sequences per inner step per learner (16)")
    g.add_argument("--lr", type=float, help="inner AdamW learning rate")
    g.add_argument("--lr-decay", type=float, dest="decay_fraction", metavar="FRACTION",
                   help="final share of the budget over which the learning rate falls to a tenth (0.2; 0: constant)")
    g.add_argument("--warmup-steps", type=int, help="inner steps over which the learning rate rises to --lr (20)")
    g.add_argument("--qk-norm", action="store_true", default=None,
                   help="LayerNorm on each head's queries and keys (off)")
    g.add_argument("--z-loss", type=float, metavar="WEIGHT",
                   help="weight of the z-loss, mean(logsumexp(logits)²), added to the training loss (0: off)")


def train_config(args):
    from dataclasses import replace

    from diloco.train.train_config import TrainConfig
    from diloco.train.loop import train_config_from_json

    path = getattr(args, "train_config", None)
    try:
        cfg = train_config_from_json(json_text(path, "--train-config")) if path else TrainConfig()
    except OSError as e:
        raise UserError(f"--train-config {path}: cannot read it: {e.strerror}") from None
    changes = {k: getattr(args, k, None) for k in ("corpus", "seed", "batch_size", "lr", "decay_fraction", "warmup_steps")}
    cfg = replace(cfg, **{k: v for k, v in changes.items() if v is not None}, **getattr(args, "train_fields", {}))
    if getattr(args, "model", None):
        cfg = replace(cfg, model=model_config(args.model))
    model_changes = {k: getattr(args, k, None) for k in ("qk_norm", "z_loss")}
    cfg = replace(cfg, model=replace(cfg.model, **{k: v for k, v in model_changes.items() if v is not None}))
    if not 0 <= cfg.decay_fraction <= 1:
        raise ValueError(f"--lr-decay must be between 0 and 1 (a share of the budget), got {cfg.decay_fraction}")
    checks.training(cfg)
    return cfg


def model_config(size: str):
    """The built-in model of a size name (`--model`)."""
    from diloco.train.train_config import ModelConfig

    # tiny: fast checks; the shape the tests and benchmarks call TINY (diloco.run.local)
    return {"small": ModelConfig(), "tiny": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=2)}[size]


def shard_spec(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"shard {text}: need 0 ≤ I < N")
    return i, n


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def address(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return text


def addresses(text: str) -> list[str]:
    return [address(part.strip()) for part in text.split(",")]


def add_config_options(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("configuration file (docs/config.md, examples/config/)")
    c.add_argument("--config", type=Path, metavar="FILE.toml",
                   help="read settings from this TOML file; flags given on the command line override it")
    c.add_argument("--print-config", action="store_true",
                   help="print the effective settings as a TOML file that --config takes, and exit")
