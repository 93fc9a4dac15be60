"""The English training and held-out text for ``train.py``: CPython's own documentation.

Sources, in this order (each a list of *documents*):

1. ``pydoc_data.topics`` — the help-topic texts that ship inside every CPython (stdlib, always
   present), one document per topic, sorted by topic name.
2. Debian's ``python3-doc`` package, if installed (``apt-get install -y python3-doc``): the HTML
   library / language / HOWTO manuals under ``/usr/share/doc/python3*/html``, stripped to text
   with ``html.parser`` (only Sphinx's main ``<div class="body" role="main">``; navigation,
   permalinks, scripts and index pages dropped), one document per page, sorted by path.

Held-out split, by document: every ``HOLDOUT_EVERY``-th document (index ``i % 20 == 10``) is a
candidate, unless its text is largely repeated elsewhere in the corpus — more than
``MAX_OVERLAP`` of its word 8-grams occur in another document. (Each pydoc topic is a section
of the HTML reference, so without this check a held-out topic would be trained on.) Candidates
are taken in order while the held-out text stays within ``HELDOUT_BUDGET`` bytes; a candidate
that does not fit, or that is repeated, goes to training. Everything else is training text. Documents are joined with a blank line; both texts are deterministic given
the sources, whose names and sha256 are recorded (``Corpus.describe``).

Both sources depend on the Python version (topics) and the Debian package (HTML), so a machine
without ``python3-doc`` — e.g. an offline GPU box — gets a different, pydoc-only corpus. To train
on exactly this machine's corpus elsewhere, export it and point ``train.py --corpus`` at it::

    python examples/tiny-tools/corpus.py --export DIR      # DIR/{train,heldout}.txt, sources.json
    python examples/tiny-tools/corpus.py --write-heldout   # heldout.txt beside this script
    python examples/tiny-tools/corpus.py                   # print the summary
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOLDOUT_EVERY = 20
HOLDOUT_PHASE = 10
HELDOUT_BUDGET = 200_000  # bytes of UTF-8
MAX_OVERLAP = 0.10  # held-out candidates may share at most this fraction of their 8-grams
NGRAM = 8
DOC_SEP = "\n\n"
HTML_GLOB = "/usr/share/doc/python3*/html"
# Sphinx navigation pages: lists of names and links, not prose.
SKIP_PAGES = re.compile(r"^(genindex.*|py-modindex|search|contents|index|download)\.html$")


@dataclass(frozen=True)
class Doc:
    source: str  # "pydoc_data.topics" | "python3-doc"
    name: str  # topic name or page path relative to the html root
    text: str


@dataclass
class Corpus:
    train_docs: list[Doc]
    heldout_docs: list[Doc]
    sources: dict[str, dict] = field(default_factory=dict)

    @property
    def train_text(self) -> str:
        return DOC_SEP.join(d.text for d in self.train_docs) + "\n"

    @property
    def heldout_text(self) -> str:
        return DOC_SEP.join(d.text for d in self.heldout_docs) + "\n"

    def describe(self) -> dict:
        train, held = self.train_text.encode(), self.heldout_text.encode()
        return {
            "sources": self.sources,
            "train": {
                "documents": len(self.train_docs),
                "bytes": len(train),
                "sha256": hashlib.sha256(train).hexdigest(),
            },
            "heldout": {
                "documents": len(self.heldout_docs),
                "bytes": len(held),
                "sha256": hashlib.sha256(held).hexdigest(),
                "names": [f"{d.source}:{d.name}" for d in self.heldout_docs],
            },
            "split": f"every {HOLDOUT_EVERY}th document (i % {HOLDOUT_EVERY} == {HOLDOUT_PHASE}) "
            f"whose word {NGRAM}-grams are <= {MAX_OVERLAP:.0%} shared with other documents, "
            f"while the held-out text stays within {HELDOUT_BUDGET} bytes",
        }


# ----------------------------------------------------------------------------------------------
# sources


def _clean(text: str) -> str:
    """Strip trailing blanks per line, collapse runs of blank lines, trim the ends."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def pydoc_docs() -> list[Doc]:
    from pydoc_data.topics import topics

    return [Doc("pydoc_data.topics", k, _clean(topics[k])) for k in sorted(topics)]


_BLOCK = {
    "p", "div", "pre", "li", "ul", "ol", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "tr", "section", "blockquote", "br", "hr", "figure", "caption",
}  # fmt: skip
_SKIP = {"script", "style", "head", "title"}


class _MainText(HTMLParser):
    """Text of Sphinx's ``<div class="body" role="main">``, paragraphs kept apart."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.depth = 0  # open <div>s inside the main body (0: outside)
        self.skip = 0  # inside script/style/headerlink
        self.pre = 0  # inside <pre>

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if self.depth == 0:
            if tag == "div" and a.get("role") == "main":
                self.depth = 1
            return
        if tag == "div":
            self.depth += 1
        if tag in _SKIP or (tag == "a" and "headerlink" in (a.get("class") or "")):
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in _BLOCK:
            self.out.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "dl") else "\n")
        elif tag == "td":
            self.out.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if self.depth == 0:
            return
        if tag == "div":
            self.depth -= 1
        if tag in _SKIP or (tag == "a" and self.skip):
            self.skip = max(0, self.skip - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _BLOCK:
            self.out.append("\n")

    def handle_data(self, data: str) -> None:
        if self.depth == 0 or self.skip:
            return
        self.out.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = [line.strip(" ") if line.strip() else "" for line in "".join(self.out).split("\n")]
        return _clean("\n".join(lines))


def html_to_text(html: str) -> str:
    parser = _MainText()
    parser.feed(html)
    parser.close()
    return parser.text()


def find_html_root() -> Path | None:
    """The CPython HTML manual of Debian's python3-doc (all its aliases resolve to one dir)."""
    roots = sorted({Path(os.path.realpath(p)) for p in glob.glob(HTML_GLOB)})
    roots = [r for r in roots if (r / "library" / "index.html").is_file()]
    return roots[-1] if roots else None  # the newest version when several are installed


def html_docs(root: Path) -> list[Doc]:
    docs = []
    pages = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.html")
        if not p.relative_to(root).parts[0].startswith("_")
    )
    for rel in pages:
        if SKIP_PAGES.match(rel):
            continue
        text = html_to_text((root / rel).read_text(encoding="utf-8", errors="replace"))
        if len(text) >= 200:  # redirects and empty stubs
            docs.append(Doc("python3-doc", rel, text))
    return docs


def _digest(docs: list[Doc]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.name}\0{d.text}\0".encode())
    return h.hexdigest()


def build(use_html: bool = True, html_root: Path | None = None) -> Corpus:
    """The corpus from this machine's sources (python3-doc only when installed and ``use_html``)."""
    docs = pydoc_docs()
    sources = {
        "pydoc_data.topics": {
            "python": sys.version.split()[0],
            "documents": len(docs),
            "sha256": _digest(docs),
        }
    }
    root = (html_root or find_html_root()) if use_html else None
    if root is not None:
        extra = html_docs(root)
        docs += extra
        sources["python3-doc"] = {
            "root": str(root),
            "documents": len(extra),
            "sha256": _digest(extra),
        }
    return split(docs, sources)


def _ngrams(text: str) -> set[bytes]:
    words = re.findall(r"\w+", text.lower())
    return {
        hashlib.blake2b(" ".join(words[i : i + NGRAM]).encode(), digest_size=8).digest()
        for i in range(len(words) - NGRAM + 1)
    }


def repeated_fraction(docs: list[Doc]) -> list[float]:
    """For each document, the fraction of its word 8-grams that also occur in another one."""
    grams = [_ngrams(d.text) for d in docs]
    seen: Counter[bytes] = Counter()
    for g in grams:
        seen.update(g)
    return [sum(seen[x] > 1 for x in g) / len(g) if g else 1.0 for g in grams]


def split(docs: list[Doc], sources: dict) -> Corpus:
    train, held, used = [], [], 0
    repeated = repeated_fraction(docs)
    for i, d in enumerate(docs):
        size = len(d.text.encode()) + len(DOC_SEP)
        candidate = i % HOLDOUT_EVERY == HOLDOUT_PHASE and repeated[i] <= MAX_OVERLAP
        if candidate and used + size <= HELDOUT_BUDGET:
            held.append(d)
            used += size
        else:
            train.append(d)
    return Corpus(train, held, sources)


# ----------------------------------------------------------------------------------------------
# exported corpora (train.txt / heldout.txt / sources.json)


def export(corpus: Corpus, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(corpus.train_text, encoding="utf-8")
    (out / "heldout.txt").write_text(corpus.heldout_text, encoding="utf-8")
    desc = corpus.describe()
    (out / "sources.json").write_text(json.dumps(desc, indent=2) + "\n", encoding="utf-8")
    return desc


@dataclass
class Texts:
    """What the trainer needs: the two texts and their provenance."""

    train: str
    heldout: str
    describe: dict


def load(corpus_dir: Path | None = None, use_html: bool = True) -> Texts:
    """Build the corpus here, or read an exported one (``--export``), checking its sha256s."""
    if corpus_dir is None:
        c = build(use_html)
        return Texts(c.train_text, c.heldout_text, c.describe())
    desc = json.loads((corpus_dir / "sources.json").read_text(encoding="utf-8"))
    train = (corpus_dir / "train.txt").read_text(encoding="utf-8")
    heldout = (corpus_dir / "heldout.txt").read_text(encoding="utf-8")
    for name, text in (("train", train), ("heldout", heldout)):
        got = hashlib.sha256(text.encode()).hexdigest()
        if got != desc[name]["sha256"]:
            raise SystemExit(f"{corpus_dir}/{name}.txt: sha256 {got} != sources.json's")
    desc = {**desc, "exported_from": str(corpus_dir)}
    return Texts(train, heldout, desc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-html", action="store_true", help="pydoc_data.topics only")
    parser.add_argument(
        "--write-heldout",
        action="store_true",
        help=f"write the held-out text to {HERE / 'heldout.txt'}",
    )
    parser.add_argument("--export", type=Path, help="write train.txt, heldout.txt, sources.json")
    args = parser.parse_args()
    corpus = build(not args.no_html)
    desc = corpus.describe()
    if args.write_heldout:
        (HERE / "heldout.txt").write_text(corpus.heldout_text, encoding="utf-8")
    if args.export:
        export(corpus, args.export)
    summary = {k: v for k, v in desc.items() if k != "heldout"}
    summary["heldout"] = {k: v for k, v in desc["heldout"].items() if k != "names"}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
